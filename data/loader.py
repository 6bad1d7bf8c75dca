"""Global batches for the training loop: the one interface train.py uses for data.

The data position is a single number, `consumed_samples`. The global batch that starts there
is samples [consumed, consumed + global_batch_size) of the split's sample order; DP rank r
takes the r-th contiguous slice and cuts it into micro batches. So any DP degree and any
micro batch split see the same samples, and resuming at `consumed_samples` continues exactly.

A micro batch is a dict of tensors, all [micro_batch_size, seq_length] unless noted:
  tokens, labels (tokens shifted by one), loss_mask (float), position_ids,
  segment_ids (document index inside the sample; only with reset_attention_mask),
  sample_ids [micro_batch_size] (global sample index: keys dropout).
"""
import numpy as np
import torch

from data import synthetic


class Loader:

  def __init__(self, config, split='train', dp_rank=0, dp_size=1):
    self.cfg = config.data
    self.split = split
    self.dp_rank, self.dp_size = dp_rank, dp_size
    self.source = synthetic.SyntheticSource(config, split)

  def global_batch(self, consumed_samples: int) -> list:
    """This DP rank's micro batches of the global batch starting at `consumed_samples`."""
    gbs, mbs = self.cfg.global_batch_size, self.cfg.micro_batch_size
    per_rank = gbs // self.dp_size
    start = consumed_samples + self.dp_rank * per_rank
    return [self.micro_batch(np.arange(i, i + mbs)) for i in range(start, start + per_rank, mbs)]

  def micro_batch(self, sample_ids) -> dict:
    windows = self.source.samples(sample_ids)          # int64 [b, seq_length + 1]
    tokens = torch.from_numpy(windows[:, :-1].copy())
    labels = torch.from_numpy(windows[:, 1:].copy())
    b, s = tokens.shape
    return {
        'tokens': tokens,
        'labels': labels,
        'loss_mask': torch.ones(b, s),
        'position_ids': torch.arange(s).expand(b, s).clone(),
        'sample_ids': torch.as_tensor(sample_ids, dtype=torch.int64),
    }
