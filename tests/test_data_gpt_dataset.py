"""GPT samples: splits, index arrays vs Megatron's build_sample_idx, windows, epochs, cache."""
import os

import numpy as np
import pytest

from data import gpt_dataset, indexed
from data.errors import DataError

SEQ = 8


def make_corpus(prefix, num_docs=60, seed=0, max_len=20):
  """Documents whose tokens are all distinct, so a window tells where it came from."""
  g = np.random.default_rng(seed)
  sizes = g.integers(0, max_len, size=num_docs)
  ends = np.cumsum(sizes)
  docs = [np.arange(e - n, e) + 1 for n, e in zip(sizes, ends)]
  indexed.write(prefix, docs, np.int32)
  return docs


def dataset(prefix, split='train', seq=SEQ, seed=7, splits='80,10,10', **kw):
  return gpt_dataset.GPTDataset(prefix, split, seq, seed, splits, **kw)


def megatron_sample_idx(sizes, doc_idx, seq_length):
  """megatron-core helpers.cpp build_sample_idx (one epoch, extra token), as a plain loop."""
  num_samples = (int(sum(sizes[d] for d in doc_idx)) - 1) // seq_length
  out, k, off = [(0, 0)], 0, 0
  for _ in range(num_samples):
    remaining = seq_length + 1
    while remaining != 0:
      length = sizes[doc_idx[k]] - off
      remaining -= length
      if remaining <= 0:
        off += remaining + length - 1
        remaining = 0
      else:
        k, off = k + 1, 0
    out.append((k, off))
  return np.array(out)


def test_split_strings_and_ranges_match_megatron():
  assert gpt_dataset.parse_splits('980,10,10') == pytest.approx([0.98, 0.01, 0.01])
  assert gpt_dataset.parse_splits('98/2') == pytest.approx([0.98, 0.02, 0.0])
  assert gpt_dataset.split_ranges([0.98, 0.01, 0.01], 1000) == [(0, 980), (980, 990), (990, 1000)]
  # Rounding leftovers go to train: 42 documents leave nothing for valid/test.
  assert gpt_dataset.split_ranges([0.98, 0.01, 0.01], 42) == [(0, 42), (42, 42), (42, 42)]
  for bad in ('0,0,0', '98,x,1'):
    with pytest.raises(DataError, match=f"data.splits_string '{bad}'"):
      gpt_dataset.parse_splits(bad)


def test_sample_index_equals_megatron_build_sample_idx():
  g = np.random.default_rng(3)
  sizes = g.integers(1, 40, size=500).astype(np.int32)
  arrays = gpt_dataset.build_epoch(sizes, 0, 16, (1, 'test'))
  order = arrays['doc_idx']
  assert sorted(order.tolist()) == list(range(500))
  assert np.array_equal(arrays['sample_idx'], megatron_sample_idx(sizes, order, 16))
  assert sorted(arrays['shuffle_idx'].tolist()) == list(range(len(arrays['sample_idx']) - 1))


def test_samples_are_the_expected_windows(tmp_path):
  prefix = str(tmp_path / 'c')
  docs = make_corpus(prefix)
  ds = dataset(prefix)
  lo, hi = ds.doc_range
  for epoch in (0, 1):
    arrays = ds.epoch(epoch)
    stream = np.concatenate([docs[d] for d in arrays['doc_idx']])
    n = ds.samples_per_epoch
    assert n == (len(stream) - 1) // SEQ
    ids = np.arange(epoch * n, (epoch + 1) * n)
    got = ds.samples(ids)
    for row, j in zip(got, arrays['shuffle_idx']):
      assert row.tolist() == stream[j * SEQ: j * SEQ + SEQ + 1].tolist()
  train_tokens = set(np.concatenate(docs[lo:hi]).tolist())
  assert set(ds.samples(np.arange(3 * ds.samples_per_epoch)).ravel().tolist()) <= train_tokens


def test_order_is_a_pure_function_of_seed_and_epoch(tmp_path):
  prefix = str(tmp_path / 'c')
  make_corpus(prefix)
  a, b = dataset(prefix), dataset(prefix, cache_dir=str(tmp_path / 'elsewhere'))
  n = a.samples_per_epoch
  ids = np.arange(3 * n)
  assert np.array_equal(a.samples(ids), b.samples(ids[::-1])[::-1])
  assert not np.array_equal(a.epoch(0)['shuffle_idx'], a.epoch(1)['shuffle_idx'])
  assert not np.array_equal(a.samples(ids[:n]), dataset(prefix, seed=8).samples(ids[:n]))
  # Each epoch serves each of its samples once; the next epoch re-cuts reshuffled documents.
  first, second = ({tuple(r) for r in a.samples(ids[k * n:(k + 1) * n]).tolist()} for k in (0, 1))
  assert len(first) == n and len(second) == n and first != second


def test_splits_hold_disjoint_documents(tmp_path):
  prefix = str(tmp_path / 'c')
  docs = make_corpus(prefix, num_docs=200)
  seen = {}
  for split in gpt_dataset.SPLITS:
    ds = dataset(prefix, split)
    seen[split] = set(ds.samples(np.arange(ds.samples_per_epoch)).ravel().tolist())
    lo, hi = ds.doc_range
    assert seen[split] <= set(np.concatenate(docs[lo:hi]).tolist())
  assert not (seen['train'] & seen['valid']) and not (seen['valid'] & seen['test'])


def cache_files(directory):
  return sorted(f for f in os.listdir(directory) if f.endswith('.npy'))


def test_cache_is_reused(tmp_path, monkeypatch):
  prefix = str(tmp_path / 'c')
  make_corpus(prefix)
  ds = dataset(prefix)
  across_epochs = np.arange(ds.samples_per_epoch - 5, ds.samples_per_epoch + 5)
  first = ds.samples(across_epochs)
  assert len(cache_files(tmp_path / 'index_cache')) == 3 * 2   # 3 arrays of epochs 0 and 1
  monkeypatch.setattr(gpt_dataset, 'build_epoch', lambda *a: pytest.fail('rebuilt a cached epoch'))
  assert np.array_equal(dataset(prefix).samples(across_epochs), first)


def test_cache_is_rebuilt_when_stale(tmp_path):
  prefix = str(tmp_path / 'c')
  make_corpus(prefix, seed=0)
  dataset(prefix).samples([0])
  before = set(cache_files(tmp_path / 'index_cache'))
  docs = make_corpus(prefix, seed=1)          # same name, other documents
  ds = dataset(prefix)
  stream = np.concatenate([docs[d] for d in ds.epoch(0)['doc_idx']])
  j = ds.epoch(0)['shuffle_idx'][0]
  assert ds.samples([0])[0].tolist() == stream[j * SEQ: j * SEQ + SEQ + 1].tolist()
  after = set(cache_files(tmp_path / 'index_cache'))
  assert len(after - before) == 3
  dataset(prefix, seq=4).samples([0])          # another seq_length is another cache entry
  assert len(set(cache_files(tmp_path / 'index_cache')) - after) == 3


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
  prefix = str(tmp_path / 'c')
  make_corpus(prefix)
  expected = dataset(prefix).samples(np.arange(10))
  directory = tmp_path / 'index_cache'
  victim = next(f for f in cache_files(directory) if 'shuffle_idx' in f)
  np.save(directory / victim, np.arange(3))
  assert np.array_equal(dataset(prefix).samples(np.arange(10)), expected)


def test_index_mapping_dir(tmp_path):
  prefix = str(tmp_path / 'c')
  make_corpus(prefix)
  dataset(prefix, cache_dir=str(tmp_path / 'maps')).samples([0])
  assert len(cache_files(tmp_path / 'maps')) == 3
  assert not (tmp_path / 'index_cache').exists()


def test_empty_documents_are_skipped(tmp_path):
  prefix = str(tmp_path / 'gaps')
  docs = [[1, 2, 3], [], [4, 5], [], [], [6, 7, 8, 9, 10], [11]]
  indexed.write(prefix, docs, np.uint16)
  ds = dataset(prefix, seq=3, splits='1,0,0')
  stream = np.concatenate([np.asarray(docs[d], np.int64) for d in ds.epoch(0)['doc_idx']])
  got = ds.samples(np.arange(ds.samples_per_epoch))
  want = [stream[j * 3: j * 3 + 4].tolist() for j in ds.epoch(0)['shuffle_idx']]
  assert got.tolist() == want


def test_split_too_small_names_file_and_split(tmp_path):
  prefix = str(tmp_path / 'tiny')
  indexed.write(prefix, [[1, 2, 3]] * 10, np.uint16)
  with pytest.raises(DataError, match=r'tiny: the valid split .* 1 of 10 documents, 3 tokens'):
    dataset(prefix, 'valid', seq=8, splits='8,1,1')


def test_token_ids_beyond_the_model_vocab(tmp_path):
  prefix = str(tmp_path / 'wide')
  indexed.write(prefix, [list(range(100))] * 4, np.uint16)
  ds = dataset(prefix, splits='1,0,0', vocab_size=64)
  with pytest.raises(DataError, match=r'wide.bin: token id 9\d outside \[0, model.vocab_size 64'):
    ds.samples(np.arange(ds.samples_per_epoch))
