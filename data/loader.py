"""Global batches for the training loop: the one interface train.py uses for data.

The data position is a single number, `consumed_samples`. The global batch that starts there
is samples [consumed, consumed + global_batch_size) of the split's sample order; DP rank r
takes the r-th contiguous slice and cuts it into micro batches. So any DP degree and any
micro batch split see the same samples, and resuming at `consumed_samples` continues exactly.

A micro batch is a dict of tensors, all [micro_batch_size, seq_length] unless noted:
  tokens, labels (tokens shifted by one), loss_mask (float), position_ids,
  segment_ids (document index inside the sample; only with reset_attention_mask),
  sample_ids [micro_batch_size] (global sample index: keys dropout).

Samples come from SFT records (`data.train_dir` / `data.val_dir`: data/sft.py, one packed or
padded row per sample, its own loss mask, positions and segments), from preference pairs when
model.objective is dpo or orpo (data/preference.py: one pair per row, two segments, and
chosen_mask / rejected_mask beside loss_mask), from `data.data_prefix` (Megatron .bin/.idx, one prefix or a weighted blend,
split by `splits_string`), or from the synthetic stream when it is empty. Validation builds
its own Loader(split='valid') and starts at consumed_samples 0 each time; so does the test
split (split='test': splits_string's third part, or data.test_dir).

Epochs. `num_samples` is the split's samples per epoch: the rows SFT / preference data builds,
one pass over a corpus split's documents (a blend: until its first dataset repeats), None for
the endless synthetic stream. The sample stream runs on across epochs (each one reshuffled),
so epoch boundaries fall inside global batches: `steps_for_epochs` and `crosses_epochs` count
a pass as done on the step whose global batch completes it.
"""
import numpy as np
import torch

from data import blend, gpt_dataset, masks, preference, sft, synthetic, tokenizer
from data.errors import DataError


class Loader:

  def __init__(self, config, split='train', dp_rank=0, dp_size=1):
    self.cfg = config.data
    self.split = split
    self.dp_rank, self.dp_size = dp_rank, dp_size
    pairs = config.model.objective in preference.OBJECTIVES
    self.sft = pairs or bool(sft.settings(config)['train_dir'])   # rows built from records
    if pairs:
      self.source = preference.PreferenceSource(config, split)
      self.num_samples = self.source.samples_per_epoch
    elif self.sft:
      self.source = sft.SFTSource(config, split)
      self.num_samples = self.source.samples_per_epoch
    elif self.cfg.data_prefix:
      self.source = corpus_source(config, split)
      self.num_samples = self.source.samples_per_epoch   # before any sample repeats
    else:
      self.source = synthetic.SyntheticSource(config, split)
      self.num_samples = None                            # endless
    self.eod_id = self._eod_id()
    self.ref_logps = None           # [rows, 2]: set by the loop with dpo.precompute_ref_log_probs

  def _eod_id(self):
    c = self.cfg
    if not (c.eod_mask_loss or c.reset_position_ids or c.reset_attention_mask):
      return None
    if self.cfg.tokenizer.type == 'none':
      raise DataError('data.eod_mask_loss / reset_position_ids / reset_attention_mask find '
                      'documents by their end-of-document token: set data.tokenizer (type and '
                      'model), or turn those options off')
    return tokenizer.load_tokenizer(self.cfg.tokenizer).eod_id

  def _epoch_samples(self):
    if self.num_samples is None:
      raise DataError('the synthetic stream (data.data_prefix=()) has no epochs; set data.data_prefix '
                      'or data.train_dir, or leave trainer.max_epochs / check_val_every_n_epoch off')
    return self.num_samples

  def steps_for_epochs(self, epochs: int) -> int:
    """Optimizer steps until `epochs` passes over the split are consumed (the last step's
    global batch completes the last pass)."""
    gbs = self.cfg.global_batch_size
    return -(-epochs * self._epoch_samples() // gbs)

  def crosses_epochs(self, before: int, after: int, every: int) -> bool:
    """Whether consuming samples [before, after) completes a multiple of `every` epochs."""
    period = every * self._epoch_samples()
    return after // period > before // period

  def global_batch(self, consumed_samples: int) -> list:
    """This DP rank's micro batches of the global batch starting at `consumed_samples`."""
    gbs, mbs = self.cfg.global_batch_size, self.cfg.micro_batch_size
    per_rank = gbs // self.dp_size
    start = consumed_samples + self.dp_rank * per_rank
    return [self.micro_batch(np.arange(i, i + mbs)) for i in range(start, start + per_rank, mbs)]

  def micro_batch(self, sample_ids) -> dict:
    if self.sft:
      batch = self.source.micro_batch(sample_ids)
      if self.ref_logps is not None:     # DPO's precomputed reference log-probs, by row
        batch['ref_logps'] = self.ref_logps[torch.from_numpy(self.source.row_ids(sample_ids))]
      return batch
    windows = self.source.samples(sample_ids)          # int64 [b, seq_length + 1]
    tokens, labels = windows[:, :-1], windows[:, 1:]
    batch = {'tokens': tokens, 'labels': labels}
    if self.eod_id is None:
      b, s = tokens.shape
      batch['loss_mask'] = np.ones((b, s), np.float32)
      batch['position_ids'] = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
    else:
      batch.update(masks.document_fields(
          tokens, self.eod_id, eod_mask_loss=self.cfg.eod_mask_loss,
          reset_position_ids=self.cfg.reset_position_ids,
          reset_attention_mask=self.cfg.reset_attention_mask))
    batch = {k: torch.from_numpy(np.array(v, order='C')) for k, v in batch.items()}
    batch['sample_ids'] = torch.as_tensor(sample_ids, dtype=torch.int64)
    return batch


def corpus_source(config, split):
  """The GPTDataset of one prefix, or the BlendedDataset of several, for `split`."""
  c = config.data
  datasets, weights = [], []
  for weight, prefix in blend.parse_data_prefix(c.data_prefix):
    datasets.append(gpt_dataset.GPTDataset(
        prefix, split, c.seq_length, config.seed, c.splits_string,
        cache_dir=c.get('index_mapping_dir'), vocab_size=config.model.vocab_size))
    weights.append(weight)
  return datasets[0] if len(datasets) == 1 else blend.BlendedDataset(datasets, weights)
