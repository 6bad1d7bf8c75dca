"""Global batches for the training loop: the one interface train.py uses for data.

The data position is a single number, `consumed_samples`. The global batch that starts there
is samples [consumed, consumed + global_batch_size) of the split's sample order; DP rank r
takes the r-th contiguous slice and cuts it into micro batches. So any DP degree and any
micro batch split see the same samples, and resuming at `consumed_samples` continues exactly.

A micro batch is a dict of tensors, all [micro_batch_size, seq_length] unless noted:
  tokens, labels (tokens shifted by one), loss_mask (float), position_ids,
  segment_ids (document index inside the sample; only with reset_attention_mask),
  sample_ids [micro_batch_size] (global sample index: keys dropout).

Samples come from the source `data.source` names (data/sources.py; `auto` picks as listed):
preference pairs when model.objective is dpo or orpo (data/preference.py: one pair per row, two
segments, and chosen_mask / rejected_mask beside loss_mask), SFT records (`data.train_dir` /
`data.val_dir`: data/sft.py, one packed or padded row per sample, its own loss mask, positions
and segments), `data.data_prefix` (Megatron .bin/.idx, one prefix or a weighted blend, split by
`splits_string`), `.jsonl` / `.parquet` text tokenized as it is read (`data.text`: data/text.py),
or the synthetic stream. Validation builds its own Loader(split='valid') and starts at
consumed_samples 0 each time; so does the test split (split='test': splits_string's third
part, data.test_dir or data.text.test).

Epochs. `num_samples` is the split's samples per epoch: the rows SFT / preference data builds,
one pass over a corpus split's documents (a blend: until its first dataset repeats), None for
the endless synthetic and text streams. The sample stream runs on across epochs (each one reshuffled),
so epoch boundaries fall inside global batches: `steps_for_epochs` and `crosses_epochs` count
a pass as done on the step whose global batch completes it.
"""
import numpy as np
import torch

from config_checks import one_of, positive
from data import gpt_dataset, masks, sources, tokenizer
from data.errors import DataError


class Loader:

  def __init__(self, config, split='train', dp_rank=0, dp_size=1, source=None, eod_id=None):
    """`source`, `eod_id`: the samples and end-of-document id to use instead of the config's
    (data/stand_in.py)."""
    self.cfg = config.data
    self.split = split
    self.dp_rank, self.dp_size = dp_rank, dp_size
    self.source_name = sources.resolve(config)
    self.source = sources.make(config, split) if source is None else source
    # records build their own micro batches (rows with their own masks): the interface tells
    self.sft = callable(getattr(self.source, 'micro_batch', None))
    self.num_samples = getattr(self.source, 'samples_per_epoch', None)   # None: endless
    self.eod_id = self._eod_id() if source is None else eod_id
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
      what, fix = _endless(self.source_name)
      raise DataError(f'{what} has no epochs; {fix}, or leave trainer.max_epochs / check_val_every_n_epoch off')
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


# --- config checks (configs/validate.py gathers them) ---------------------------------


# Sources without epochs: what each is, and the fix for a setting that counts epochs.
ENDLESS = {'synthetic': ('the synthetic stream (data.data_prefix=())', 'set data.data_prefix or data.train_dir'),
           'text': ("the text source (data.source='text'), an endless stream repeating its files,",
                    'count in steps instead (trainer.max_steps, trainer.val_check_interval)')}


def _endless(name):
  return ENDLESS.get(name, (f'the {name!r} source', 'choose a source with epochs'))


def _records(config) -> bool:
  """Whether the data are SFT / preference records (else token windows)."""
  return sources.resolve(config) in ('sft', 'preference')


def check(config, dp) -> list:
  """Problems with the data section at data-parallel size `dp`."""
  problems, data = [], config.data
  positive(problems, 'data.micro_batch_size', data.micro_batch_size)
  positive(problems, 'data.seq_length', data.seq_length)
  if data.micro_batch_size > 0 and data.global_batch_size % (data.micro_batch_size * dp):
    problems.append(f'data.global_batch_size={data.global_batch_size} is not divisible by micro_batch_size x '
                    f'data-parallel size = {data.micro_batch_size} x {dp}; use a multiple of '
                    f'{data.micro_batch_size * dp}')
  one_of(problems, 'data.tokenizer.type', data.tokenizer.type, tokenizer.TYPES)
  problems += sources.check(config)
  if data.data_prefix and len(data.data_prefix) > 1 and len(data.data_prefix) % 2:
    problems.append('data.data_prefix must be (prefix,) or (weight1, prefix1, weight2, prefix2, ...)')
  if sources.resolve(config) == 'synthetic' and data.synthetic_vocab_size > config.model.vocab_size:
    problems.append(f'data.synthetic_vocab_size={data.synthetic_vocab_size} exceeds '
                    f'model.vocab_size={config.model.vocab_size}')
  return problems


def check_epochs(config) -> list:
  """trainer.max_epochs, check_val_every_n_epoch and limit_test_batches against the data:
  the synthetic and text streams have no epochs, records need data.test_dir, a corpus a test
  share, text data.text.test."""
  problems, t, data = [], config.trainer, config.data
  if t.max_epochs != -1:
    positive(problems, 'trainer.max_epochs', t.max_epochs)
  if t.check_val_every_n_epoch is not None:
    positive(problems, 'trainer.check_val_every_n_epoch', t.check_val_every_n_epoch)
  name = sources.resolve(config)
  for key, value, off in (('max_epochs', t.max_epochs, '-1'),
                          ('check_val_every_n_epoch', t.check_val_every_n_epoch, 'None')):
    if name in ENDLESS and value is not None and value > 0:
      what, fix = ENDLESS[name]
      problems.append(f'trainer.{key}={value} counts passes over the train split, but {what} has no epochs; '
                      f'{fix}, or trainer.{key}={off}')
  positive(problems, 'trainer.limit_test_batches', t.limit_test_batches, allow_zero=True)
  if t.limit_test_batches > 0 and _records(config) and not data.test_dir:
    problems.append(f'trainer.limit_test_batches={t.limit_test_batches} evaluates the test records: set '
                    'data.test_dir (same formats as data.val_dir), or trainer.limit_test_batches=0')
  elif t.limit_test_batches > 0 and name == 'text' and not sources.is_set(config, 'data.text.test'):
    problems.append(f'trainer.limit_test_batches={t.limit_test_batches} evaluates the test split: set '
                    'data.text.test (.jsonl / .parquet files or globs), or trainer.limit_test_batches=0')
  elif t.limit_test_batches > 0 and name == 'indexed':
    try:
      if gpt_dataset.parse_splits(data.splits_string)[2] == 0:
        problems.append(f'data.splits_string={data.splits_string!r} gives the test split no documents but '
                        f'trainer.limit_test_batches={t.limit_test_batches}; give its third part a share '
                        "(e.g. '980,10,10') or set trainer.limit_test_batches=0")
    except DataError as e:
      problems.append(str(e))
  return problems
