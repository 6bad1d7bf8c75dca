"""Weighted blending of several GPT datasets (`data_prefix: (w1, prefix1, w2, prefix2, ...)`).

Sample i of the blend comes from dataset d = pattern[i % B] and is that dataset's sample
(i // B) * count[d] + rank[i % B]: a fixed interleaving block of B samples, repeated. Inside
a block, dataset d's k-th sample sits where its ideal time (k + 1/2) / w_d falls among all
datasets' ideal times, so every prefix of the blend holds within about one sample of w_d of
each dataset (Megatron's greedy "most behind first" rule gives the same guarantee), and each
block realizes the weights to within 1/B. A lookup is O(1): no per-sample loop, no index
that grows with the run, and each dataset cycles through its own epochs independently.
"""
import numpy as np

from data.errors import DataError

BLOCK = 1 << 16


def parse_data_prefix(data_prefix) -> list:
  """(prefix,) | (w1, p1, w2, p2, ...) -> [(weight, prefix)] with weights summing to 1."""
  items = [data_prefix] if isinstance(data_prefix, str) else list(data_prefix)
  if len(items) == 1:
    return [(1.0, str(items[0]))]
  if len(items) % 2:
    raise DataError(f'data.data_prefix {tuple(items)}: give one prefix, or weight/prefix '
                    'pairs (w1, prefix1, w2, prefix2, ...)')
  pairs = []
  for w, p in zip(items[0::2], items[1::2]):
    try:
      pairs.append((float(w), str(p)))
    except (TypeError, ValueError):
      raise DataError(f'data.data_prefix: weight {w!r} (before {p!r}) is not a number; give '
                      'weight/prefix pairs (w1, prefix1, w2, prefix2, ...)') from None
  total = sum(w for w, _ in pairs)
  if any(w < 0 for w, _ in pairs) or total <= 0:
    raise DataError(f'data.data_prefix weights {[w for w, _ in pairs]} must be >= 0 with a '
                    'positive sum')
  return [(w / total, p) for w, p in pairs]


def interleave(weights, block: int = BLOCK):
  """(pattern [block] dataset per slot, rank [block] k-th use of that dataset, count [D])."""
  weights = np.asarray(weights, np.float64)
  datasets, ranks, times = [], [], []
  for d, w in enumerate(weights):
    if w <= 0:
      continue
    k = np.arange(int(np.ceil(block * w)) + 1)
    datasets.append(np.full(len(k), d))
    ranks.append(k)
    times.append((k + 0.5) / w)
  datasets, ranks, times = map(np.concatenate, (datasets, ranks, times))
  order = np.lexsort((datasets, times))[:block]      # ties go to the lower dataset index
  pattern, rank = datasets[order], ranks[order]
  return pattern, rank, np.bincount(pattern, minlength=len(weights))


class BlendedDataset:
  """`samples(ids)` over several datasets mixed by weight; same interface as GPTDataset."""

  def __init__(self, datasets, weights, block: int = BLOCK):
    self.datasets = list(datasets)
    self.weights = np.asarray(weights, np.float64) / np.sum(weights)
    self.seq_length = self.datasets[0].seq_length
    self.pattern, self.rank, self.count = interleave(self.weights, block)
    self.block = block

  def locate(self, sample_ids):
    """(dataset index, sample index inside that dataset) of each blended sample."""
    blocks, slot = np.divmod(np.asarray(sample_ids, np.int64), self.block)
    d = self.pattern[slot]
    return d, blocks * self.count[d] + self.rank[slot]

  @property
  def samples_per_epoch(self) -> int:
    """Blended samples before the first dataset starts repeating itself."""
    return int(min(ds.samples_per_epoch / w for ds, w in zip(self.datasets, self.weights) if w > 0))

  def samples(self, sample_ids) -> np.ndarray:
    d, inner = self.locate(sample_ids)
    out = np.empty((len(d), self.seq_length + 1), np.int64)
    for which in np.unique(d):
      rows = np.nonzero(d == which)[0]
      out[rows] = self.datasets[which].samples(inner[rows])
    return out
