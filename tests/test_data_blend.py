"""Weighted blending: parsing, realized ratios at every prefix, each dataset read in order."""
import numpy as np
import pytest

from data import blend, gpt_dataset, indexed
from data.errors import DataError


def test_parse_data_prefix():
  assert blend.parse_data_prefix(('/d/a',)) == [(1.0, '/d/a')]
  assert blend.parse_data_prefix('/d/a') == [(1.0, '/d/a')]
  assert blend.parse_data_prefix((3, '/d/a', '1', '/d/b')) == [(0.75, '/d/a'), (0.25, '/d/b')]
  with pytest.raises(DataError, match='weight/prefix pairs'):
    blend.parse_data_prefix((0.5, '/d/a', 0.5))
  with pytest.raises(DataError, match="weight '/d/a'"):
    blend.parse_data_prefix(('/d/a', '/d/b'))
  with pytest.raises(DataError, match='positive sum'):
    blend.parse_data_prefix((0, '/d/a', 0, '/d/b'))


@pytest.mark.parametrize('weights', [[0.5, 0.5], [0.7, 0.2, 0.1], [0.01, 0.99], [0.3, 0.0, 0.7],
                                     [1 / 3, 1 / 3, 1 / 3]])
def test_every_prefix_is_within_one_sample_of_the_weights(weights):
  block = 10_000
  pattern, rank, count = blend.interleave(weights, block)
  w = np.asarray(weights) / np.sum(weights)
  assert count.sum() == block
  assert np.all(np.abs(count - block * w) <= 1)
  chosen = np.eye(len(w), dtype=np.int64)[pattern]           # [block, datasets] one-hot
  realized = np.cumsum(chosen, axis=0)
  ideal = np.arange(1, block + 1)[:, None] * w[None, :]
  assert np.abs(realized - ideal).max() <= 1.0
  # rank counts each dataset's uses in order: 0, 1, 2, ...
  for d in range(len(w)):
    assert rank[pattern == d].tolist() == list(range(count[d]))


def write_corpus(prefix, first_token, num_docs=30):
  docs = [np.arange(first_token + 50 * i, first_token + 50 * i + 40) for i in range(num_docs)]
  indexed.write(prefix, docs, np.int32)


def test_blended_dataset_mixes_by_weight_and_reads_each_dataset_in_order(tmp_path):
  prefixes = [str(tmp_path / 'a'), str(tmp_path / 'b')]
  write_corpus(prefixes[0], 0)
  write_corpus(prefixes[1], 100_000)
  sets = [gpt_dataset.GPTDataset(p, 'train', 16, 5, '1,0,0') for p in prefixes]
  mixed = blend.BlendedDataset(sets, [0.8, 0.2], block=1000)
  ids = np.arange(5000)                                      # many epochs of both datasets
  windows = mixed.samples(ids)
  from_b = windows[:, 0] >= 100_000
  assert from_b.mean() == pytest.approx(0.2, abs=0.002)
  d, inner = mixed.locate(ids)
  assert np.array_equal(d == 1, from_b)
  for which in (0, 1):                                       # no gaps, no repeats
    assert inner[d == which].tolist() == list(range((d == which).sum()))
    assert np.array_equal(windows[d == which], sets[which].samples(inner[d == which]))


def test_blend_lookup_is_position_independent(tmp_path):
  write_corpus(str(tmp_path / 'a'), 0)
  write_corpus(str(tmp_path / 'b'), 100_000)
  sets = [gpt_dataset.GPTDataset(str(tmp_path / p), 'train', 16, 5, '1,0,0') for p in 'ab']
  mixed = blend.BlendedDataset(sets, [0.6, 0.4])
  ids = np.arange(0, 200_000, 997)
  assert np.array_equal(mixed.samples(ids)[5:9], mixed.samples(ids[5:9]))
