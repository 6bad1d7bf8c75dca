"""data/sources.py: data.source picks the Loader's samples by name. auto chooses as the keys say,
explicit names are checked against the settings (none missing, none left unused), an unknown
name lists the registered ones, and a source a fork registers is read by the Loader, which
tells token windows from records by their interface."""
import json

import numpy as np
import pytest
import torch
from ml_collections import config_dict

from configs import base, validate
from data import gpt_dataset, indexed, loader, sft, sources, synthetic
from data.errors import DataError


def config(**keys):
  """The base config with a small batch and dotted keys set ('data.text.train': (...))."""
  c = base.get_config()
  c.model.vocab_size, c.data.seq_length = 64, 8
  c.data.micro_batch_size, c.data.global_batch_size = 2, 4
  for key, value in keys.items():
    *path, leaf = key.split('.')
    node = c
    for part in path:
      node = node[part]
    node[leaf] = value
  return c


def records(path, n):
  with open(path, 'w') as f:
    for i in range(n):
      f.write(json.dumps({'input_ids': list(range(1, 6 + i % 3)), 'loss_mask': [1] * (5 + i % 3)}) + '\n')
  return str(path)


@pytest.mark.parametrize('keys,name', [
    ({}, 'synthetic'),
    ({'data.data_prefix': ('corpus',)}, 'indexed'),
    ({'data.train_dir': 'sft.jsonl'}, 'sft'),
    ({'data.train_dir': 'sft.jsonl', 'data.data_prefix': ('corpus',)}, 'sft'),     # train_dir first, as ever
    ({'model.objective': 'dpo'}, 'preference'),
    ({'model.objective': 'orpo', 'data.train_dir': 'pairs.jsonl'}, 'preference'),
    ({'data.text.train': ('a.jsonl',)}, 'text'),
])
def test_auto_chooses_as_the_keys_say(keys, name):
  c = config(**keys)
  assert sources.resolve(c) == name
  assert sources.check(c) == []


def test_auto_builds_the_sources_it_always_built(tmp_path):
  assert isinstance(loader.Loader(config()).source, synthetic.SyntheticSource)
  prefix = str(tmp_path / 'corpus')
  indexed.write(prefix, [[1 + i % 9] * 30 for i in range(40)], np.uint16)
  corpus = loader.Loader(config(**{'data.data_prefix': (prefix,), 'data.index_mapping_dir': str(tmp_path)}))
  assert isinstance(corpus.source, gpt_dataset.GPTDataset) and not corpus.sft
  rows = loader.Loader(config(**{'data.train_dir': records(tmp_path / 'sft.jsonl', 8)}))
  assert isinstance(rows.source, sft.SFTSource) and rows.sft and rows.num_samples == rows.source.samples_per_epoch


def test_an_explicit_name_builds_its_source(tmp_path):
  assert isinstance(loader.Loader(config(**{'data.source': 'synthetic'})).source, synthetic.SyntheticSource)
  c = config(**{'data.source': 'sft', 'data.train_dir': records(tmp_path / 'sft.jsonl', 8)})
  assert isinstance(loader.Loader(c).source, sft.SFTSource)


@pytest.mark.parametrize('keys,message', [
    ({'data.source': 'text', 'data.text.train': ('a.jsonl',), 'data.data_prefix': ('corpus',)},
     "data.source='text' does not read data.data_prefix=('corpus',) (the 'indexed' source's): unset "
     "data.data_prefix, or set data.source='indexed'"),
    ({'data.source': 'text'},
     "data.source='text' needs data.text.train (.jsonl / .parquet files or globs), but data.text.train=(); "
     'set data.text.train, or choose another data.source'),
    ({'data.source': 'synthetic', 'data.train_dir': 'sft.jsonl'},
     "data.source='synthetic' does not read data.train_dir='sft.jsonl' (the 'sft' or 'preference' source's): "
     "unset data.train_dir, or set data.source='sft' or 'preference'"),
    ({'data.source': 'sft', 'data.train_dir': 'sft.jsonl', 'model.objective': 'dpo'},
     "data.source='sft' does not read model.objective='dpo' (the 'preference' source's): set "
     "model.objective='next_token', or set data.source='preference'"),
    ({'data.source': 'preference', 'data.train_dir': 'pairs.jsonl'},
     "data.source='preference' needs model.objective (dpo or orpo), but model.objective='next_token'"),
    ({'data.source': 'indexed', 'data.data_prefix': ('corpus',), 'data.synthetic_vocab_size': 32},
     "does not read data.synthetic_vocab_size=32 (the 'synthetic' source's)"),
    # auto: the text keys are new, so no precedence quietly drops them
    ({'data.data_prefix': ('corpus',), 'data.text.train': ('a.jsonl',)},
     "data.source='auto' (choosing 'indexed') does not read data.text.train=('a.jsonl',) (the 'text' source's)"),
    ({'data.text.valid': ('v.jsonl',)}, "(choosing 'synthetic') does not read data.text.valid=('v.jsonl',)"),
    ({'data.source': 'shards'}, "data.source='shards' is not a registered source; registered: auto, indexed, "
                                'preference, sft, synthetic, text'),
])
def test_a_wrong_choice_is_refused_naming_both_settings_and_the_fix(keys, message):
  c = config(**keys)
  assert any(message in p for p in sources.check(c)), sources.check(c)
  assert any(message in p for p in validate.check(c))          # gathered with the config's other checks
  with pytest.raises(DataError, match='data.source='):
    loader.Loader(c)


class Windows:
  """A fork's token-window source: sample i is i, i + 1, ... (mod 50); endless."""
  samples_per_epoch = None

  def __init__(self, config, split):
    self.seq_length, self.first = config.data.seq_length, config.data.shards.first

  def samples(self, sample_ids):
    return (np.asarray(sample_ids)[:, None] + self.first + np.arange(self.seq_length + 1)) % 50


class Rows(Windows):
  """A fork's record source: its own micro batches; 10 rows per epoch."""
  samples_per_epoch = 10

  def row_ids(self, sample_ids):
    return np.asarray(sample_ids) % 10

  def micro_batch(self, sample_ids):
    tokens = torch.from_numpy(self.samples(self.row_ids(sample_ids)))
    return {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:], 'sample_ids': torch.as_tensor(sample_ids)}


@pytest.fixture
def registry(monkeypatch):
  monkeypatch.setattr(sources, 'REGISTRY', dict(sources.REGISTRY))   # the test's registrations go with it


def forked(name, first=3):
  c = config(**{'data.source': name})
  c.data.shards = config_dict.ConfigDict({'first': first})
  return c


def test_a_registered_source_is_read_by_the_loader(registry):
  sources.register('windows', Windows, needs={'data.shards.first': 'the first token'})
  ld = loader.Loader(forked('windows'))
  assert not ld.sft and ld.num_samples is None
  mb = ld.global_batch(4)[0]
  assert mb['tokens'][0].tolist() == list(range(7, 15)) and mb['labels'][0, -1] == 15
  with pytest.raises(DataError, match="the 'windows' source has no epochs"):
    ld.steps_for_epochs(1)

  @sources.register('rows', needs={'data.shards.first': 'the first token'})
  def rows(config, split):    # pylint: disable=unused-variable
    return Rows(config, split)
  rows_loader = loader.Loader(forked('rows'))
  assert rows_loader.sft and rows_loader.num_samples == 10 and rows_loader.steps_for_epochs(1) == 3
  assert rows_loader.global_batch(12)[1]['tokens'][0, 0] == 3 + 4


def test_a_registered_sources_settings_are_checked(registry):
  sources.register('windows', Windows, needs={'data.shards.first': 'the first token'})
  assert sources.check(forked('windows', first=0)) == [
      "data.source='windows' needs data.shards.first (the first token), but data.shards.first=0; set "
      'data.shards.first, or choose another data.source']
  c = forked('windows')
  c.data.source = 'synthetic'
  assert sources.check(c) == ["data.source='synthetic' does not read data.shards.first=3 (the 'windows' "
                              "source's): unset data.shards.first, or set data.source='windows'"]
  assert 'windows' in sources.names()


def test_the_text_stream_has_no_epochs_and_its_test_split_needs_files():
  c = config(**{'data.text.train': ('a.jsonl',), 'trainer.max_epochs': 2, 'trainer.limit_test_batches': 1})
  assert loader.check_epochs(c) == [
      "trainer.max_epochs=2 counts passes over the train split, but the text source (data.source='text'), an "
      'endless stream repeating its files, has no epochs; count in steps instead (trainer.max_steps, '
      'trainer.val_check_interval), or trainer.max_epochs=-1',
      'trainer.limit_test_batches=1 evaluates the test split: set data.text.test (.jsonl / .parquet files or '
      'globs), or trainer.limit_test_batches=0']
  c.data.text.test, c.trainer.max_epochs = ('t.jsonl',), -1
  assert loader.check_epochs(c) == []


def test_a_key_two_sources_read_is_named_once():
  c = config(**{'data.source': 'text', 'data.text.train': ('a.jsonl',), 'data.train_dir': 'sft.jsonl'})
  assert len(sources.check(c)) == 1
