"""GPT samples from one indexed dataset: windows of seq_length + 1 tokens across documents.

Like megatron-core's GPTDataset, a split is a contiguous range of sequences ("documents")
cut by `splits_string`, and each sample is described by three index arrays:
  doc_idx     the split's documents in this epoch's shuffled order
  sample_idx  [n + 1, 2] (position in doc_idx, token offset) where sample j starts; sample j
              ends on the token where sample j + 1 starts (labels are tokens shifted by one)
  shuffle_idx the order in which the epoch's n samples are served
Unlike Megatron, every epoch is built on its own, keyed by (seed, split, epoch): sample i of
the split is sample shuffle_idx[i % n] of epoch i // n. So there is no "number of samples
to build for" — a run can go on for as many epochs as it likes — and the sample order is a
pure function of (seed, epoch). Building one epoch is a permutation, a cumsum and a
searchsorted, i.e. seconds for billions of tokens; the arrays are cached anyway.
"""
import os
from collections import OrderedDict

import numpy as np

from data import index_cache, indexed
from data.errors import DataError
import rng

SPLITS = ('train', 'valid', 'test')
ARRAYS = ('doc_idx', 'sample_idx', 'shuffle_idx')
EPOCHS_KEPT = 2   # a batch spans at most two epochs


def parse_splits(splits_string: str) -> list:
  """'980,10,10' (or '98/1/1', or '99') -> three fractions summing to 1, as in Megatron."""
  fix = 'need non-negative weights with a positive sum, e.g. "980,10,10"'
  sep = ',' if ',' in splits_string else '/'
  try:
    weights = [float(w) for w in splits_string.split(sep) if w.strip()]
  except ValueError:
    raise DataError(f'data.splits_string {splits_string!r}: {fix}') from None
  weights = (weights + [0.0] * 3)[:3]
  if any(w < 0 for w in weights) or sum(weights) <= 0:
    raise DataError(f'data.splits_string {splits_string!r}: {fix}')
  return [w / sum(weights) for w in weights]


def split_ranges(fractions, num_docs: int) -> list:
  """[(lo, hi)] per split, megatron-core's get_split_indices (rounding error goes to train)."""
  bounds = [0]
  for f in fractions:
    bounds.append(bounds[-1] + int(round(f * float(num_docs))))
  diff = bounds[-1] - num_docs
  bounds = [0] + [b - diff for b in bounds[1:]]
  return list(zip(bounds[:-1], bounds[1:]))


def build_epoch(sizes, first_doc: int, seq_length: int, key: tuple) -> dict:
  """Index arrays of one epoch over documents first_doc .. first_doc + len(sizes)."""
  num_docs = len(sizes)
  index_dtype = np.int32 if first_doc + num_docs < 2**31 else np.int64
  order = np.random.default_rng(rng.key_to_seed(*key, 'documents')).permutation(num_docs)
  doc_idx = (order + first_doc).astype(index_dtype)
  doc_ends = np.cumsum(np.asarray(sizes, np.int64)[order])
  num_samples = (int(doc_ends[-1]) - 1) // seq_length
  starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
  # 'right' skips empty documents: a sample starts in the first document ending after it.
  pos = np.searchsorted(doc_ends, starts, side='right')
  offset = starts - (doc_ends[pos] - np.asarray(sizes, np.int64)[order[pos]])
  sample_idx = np.stack([pos, offset], axis=1).astype(np.int64)
  shuffle_idx = np.random.default_rng(rng.key_to_seed(*key, 'samples')).permutation(num_samples)
  return {'doc_idx': doc_idx, 'sample_idx': sample_idx, 'shuffle_idx': shuffle_idx}


class GPTDataset:
  """Samples of one split of one indexed dataset; `samples(ids)` -> int64 [b, seq_length + 1]."""

  def __init__(self, prefix: str, split: str, seq_length: int, seed: int, splits_string: str,
               cache_dir: str = None, vocab_size: int = None):
    if split not in SPLITS:
      raise DataError(f'{prefix}: split must be one of {SPLITS}, got {split!r}')
    self.data = indexed.IndexedDataset(prefix)
    self.prefix, self.split, self.seq_length, self.seed = prefix, split, seq_length, seed
    self.vocab_size = vocab_size
    ranges = split_ranges(parse_splits(splits_string), len(self.data))
    self.doc_range = ranges[SPLITS.index(split)]
    lo, hi = self.doc_range
    self.sizes = self.data.sizes[lo:hi]
    self.num_tokens = int(self.sizes.sum(dtype=np.int64))
    self.samples_per_epoch = max(self.num_tokens - 1, 0) // seq_length
    if self.samples_per_epoch == 0:
      raise DataError(
          f'{prefix}: the {split} split (splits_string {splits_string!r}) holds {hi - lo} of '
          f'{len(self.data)} documents, {self.num_tokens} tokens; one sample needs '
          f'seq_length + 1 = {seq_length + 1}. Use more data or a larger {split} share.')
    self.cache = self._make_cache(cache_dir)
    self._epochs = OrderedDict()

  def _make_cache(self, cache_dir):
    description = {'format': index_cache.FORMAT, 'prefix': os.path.abspath(self.prefix),
                   'split': self.split, 'doc_range': list(self.doc_range),
                   'seq_length': self.seq_length, 'seed': self.seed,
                   'sizes_digest': index_cache.digest(np.asarray(self.data.sizes))}
    stem_hash = index_cache.digest(*sorted((k, v) for k, v in description.items() if k != 'prefix'))
    directory = cache_dir or os.path.join(os.path.dirname(os.path.abspath(self.prefix)),
                                          'index_cache')
    stem = f'{os.path.basename(self.prefix)}-{self.split}-{stem_hash}'
    return index_cache.IndexCache(directory, stem, description)

  def epoch(self, e: int) -> dict:
    """The index arrays of epoch e: from memory, from the cache, or built (and cached)."""
    if e in self._epochs:
      self._epochs.move_to_end(e)
      return self._epochs[e]
    arrays = self.cache.load(e, ARRAYS)
    if arrays is None or not self._consistent(arrays):
      arrays = build_epoch(self.sizes, self.doc_range[0], self.seq_length,
                           (self.seed, 'gpt_dataset', self.split, e))
      self.cache.save(e, arrays)
    self._epochs[e] = arrays
    while len(self._epochs) > EPOCHS_KEPT:
      self._epochs.popitem(last=False)
    return arrays

  def _consistent(self, arrays) -> bool:
    n = self.samples_per_epoch
    return (arrays['doc_idx'].shape == (len(self.sizes),)
            and arrays['sample_idx'].shape == (n + 1, 2) and arrays['shuffle_idx'].shape == (n,))

  def samples(self, sample_ids) -> np.ndarray:
    """Token windows of the split's samples `sample_ids` (any non-negative ints), int64."""
    ids = np.asarray(sample_ids, np.int64).reshape(-1)
    out = np.empty((len(ids), self.seq_length + 1), np.int64)
    epochs, within = np.divmod(ids, self.samples_per_epoch)
    for e in np.unique(epochs):
      rows = np.nonzero(epochs == e)[0]
      arrays = self.epoch(int(e))
      out[rows] = self._windows(arrays, np.asarray(arrays['shuffle_idx'][within[rows]]))
    if self.vocab_size is not None and out.size and (out.max() >= self.vocab_size or out.min() < 0):
      bad = int(out.max()) if out.max() >= self.vocab_size else int(out.min())
      raise DataError(f'{self.prefix}.bin: token id {bad} outside [0, model.vocab_size '
                      f'{self.vocab_size}); was the data tokenized with another tokenizer? '
                      "Re-run tools/preprocess.py with the model's tokenizer, or raise "
                      'model.vocab_size')
    return out

  def _windows(self, arrays, rows) -> np.ndarray:
    """Gathers each sample's pieces of consecutive documents in one vectorized read."""
    doc_idx, sample_idx = arrays['doc_idx'], arrays['sample_idx']
    first_pos, first_off = sample_idx[rows, 0], sample_idx[rows, 1]
    last_pos, last_off = sample_idx[rows + 1, 0], sample_idx[rows + 1, 1]
    pieces = last_pos - first_pos + 1
    piece_start = np.cumsum(pieces) - pieces
    rank_in_sample = np.arange(pieces.sum()) - np.repeat(piece_start, pieces)
    pos = np.repeat(first_pos, pieces) + rank_in_sample
    seq = np.asarray(doc_idx[pos], np.int64)
    begin = np.where(rank_in_sample == 0, np.repeat(first_off, pieces), 0)
    end = np.where(pos == np.repeat(last_pos, pieces), np.repeat(last_off, pieces) + 1,
                   self.data.sizes[seq])
    lengths = end - begin
    token_start = self.data.token_start(seq) + begin
    run_start = np.cumsum(lengths) - lengths
    flat = np.repeat(token_start - run_start, lengths) + np.arange(lengths.sum())
    return np.asarray(self.data.tokens[flat], np.int64).reshape(len(rows), self.seq_length + 1)
