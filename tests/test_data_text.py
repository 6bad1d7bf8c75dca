"""data/text.py: .jsonl / .parquet text tokenized as it is read. Windows are the files'
concatenated tokenization (computed here on its own), repeating; a fresh loader at any
consumed_samples and DP degree continues exactly, with or without the saved token counts; the
counts spare a restart the prefix and are rebuilt when a file changes; a run resumed from its
checkpoint trains bitwise as the uninterrupted one."""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from configs import base, llama_tiny
from data import loader, text, text_files, tokenizer
from data.errors import DataError

SEQ = 16


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A SentencePiece tokenizer and 60 documents of 1 to 40 words (a few shorter than a window,
  some longer), as two JSONL files and the same texts as parquet."""
  root = tmp_path_factory.mktemp('text')
  words = 'thou art more lovely and more temperate rough winds do shake the buds of may'.split()
  g = np.random.default_rng(0)
  texts = [' '.join(g.choice(words, size=g.integers(1, 40))) for _ in range(60)]
  (root / 'train.txt').write_text('\n'.join(texts))
  model = tokenizer.train_sentencepiece([str(root / 'train.txt')], str(root / 'tok'), 300)
  for name, part in (('a', texts[:25]), ('b', texts[25:])):
    write_jsonl(root / f'{name}.jsonl', part)
    pq.write_table(pa.table({'id': list(range(len(part))), 'text': part}), root / f'{name}.parquet', row_group_size=7)
  return {'root': root, 'texts': texts, 'model': model}


def write_jsonl(path, texts, key='text'):
  with open(path, 'w', encoding='utf-8') as f:
    for i, t in enumerate(texts):
      f.write(json.dumps({key: t, 'id': i}) + '\n' + ('\n' if i == 3 else ''))   # a blank line: skipped
  return str(path)


def make_config(corpus, files=('a.jsonl', 'b.jsonl'), cache='counts', **data):
  c = base.get_config()
  c.model.vocab_size = 300
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = SEQ, 2, 8
  c.data.source = 'text'
  c.data.text.train = tuple(str(corpus['root'] / f) for f in files)
  c.data.index_mapping_dir = str(corpus['root'] / cache)
  c.data.tokenizer.type, c.data.tokenizer.model = 'sentencepiece', corpus['model']
  for k, v in data.items():
    setattr(c.data, k, v)
  return c


def stream(corpus, texts=None):
  """The tokenization the source must serve, made here: each text's ids then EOD, in order."""
  tok = tokenizer.load_tokenizer({'type': 'sentencepiece', 'model': corpus['model']})
  return np.concatenate([tok.encode(t) + [tok.eod_id] for t in (texts or corpus['texts'])])


def windows(s, ids):
  """Sample i of the endless stream s: tokens [i·SEQ, i·SEQ + SEQ + 1), s repeating."""
  return np.stack([np.resize(s, (i + 2) * SEQ + len(s))[i * SEQ:i * SEQ + SEQ + 1] for i in ids])


class Counting:
  """A tokenizer whose encode calls are counted."""

  def __init__(self, tok):
    self.tok, self.calls = tok, 0

  def encode(self, text_):
    self.calls += 1
    return self.tok.encode(text_)


def counted(config):
  source = text.TextSource(config, 'train')
  source.tokenizer = Counting(source.tokenizer)
  return source


def test_windows_are_the_concatenated_tokenization_repeating(corpus):
  s = stream(corpus)
  passes = 3 * len(s) // SEQ                  # three passes: windows across the wrap
  source = text.TextSource(make_config(corpus, cache='windows'))
  assert source.samples_per_epoch is None
  np.testing.assert_array_equal(source.samples(np.arange(passes)), windows(s, range(passes)))
  jumps = [passes - 1, 0, 7, passes // 2, 3]   # in any order: each window is a pure function of its index
  np.testing.assert_array_equal(text.TextSource(make_config(corpus, cache='jumps')).samples(jumps), windows(s, jumps))


def test_a_glob_is_its_matches_in_order(corpus):
  ids = [0, 3, 150]
  want = text.TextSource(make_config(corpus, cache='glob')).samples(ids)
  assert np.array_equal(text.TextSource(make_config(corpus, ('*.jsonl',), cache='glob')).samples(ids), want)


def test_jsonl_and_parquet_give_the_same_windows(corpus, monkeypatch):
  monkeypatch.setattr(text_files, 'BATCH_ROWS', 3)     # record batches inside row groups of 7
  ids = [0, 40, 3, 100, 41]
  want = text.TextSource(make_config(corpus, cache='j')).samples(ids)
  for files in (('a.parquet', 'b.parquet'), ('a.jsonl', 'b.parquet')):
    assert np.array_equal(text.TextSource(make_config(corpus, files, cache='-'.join(files))).samples(ids), want)


def run(config, consumed, steps, dp_size=1):
  loaders = [loader.Loader(config, 'train', r, dp_size) for r in range(dp_size)]
  gbs = config.data.global_batch_size
  return [torch.cat([mb['tokens'] for ld in loaders for mb in ld.global_batch(consumed + k * gbs)])
          for k in range(steps)]


@pytest.mark.parametrize('dp', [1, 2])
@pytest.mark.parametrize('cached', [True, False])
def test_a_fresh_loader_at_consumed_samples_continues_exactly(corpus, dp, cached):
  straight = run(make_config(corpus, cache=f'straight-{dp}-{cached}'), 0, 12)     # past the first pass
  fresh = make_config(corpus, cache=f'straight-{dp}-{cached}' if cached else f'fresh-{dp}')
  resumed = run(fresh, 7 * 8, 5, dp)
  assert all(torch.equal(a, b) for a, b in zip(straight[7:], resumed))
  assert loader.Loader(fresh).num_samples is None


def test_the_saved_counts_spare_a_restart_the_prefix_and_a_changed_file_rebuilds_them(corpus, tmp_path):
  files = [write_jsonl(tmp_path / 'a.jsonl', corpus['texts'][:30]), write_jsonl(tmp_path / 'b.jsonl', corpus['texts'][30:])]
  c = make_config(corpus, cache='spare')
  c.data.text.train = tuple(files)
  late = len(stream(corpus)) // SEQ + 5           # in the second pass: the first counted whole
  first = counted(c)
  want = first.samples([late])
  assert first.tokenizer.calls == 60 and os.path.exists(first.cache_path)   # each document once
  again = counted(c)
  assert np.array_equal(again.samples([late]), want) and again.tokenizer.calls <= 3   # the window's documents only

  texts = corpus['texts'][:30] + ['thou art more lovely'] + corpus['texts'][30:]
  write_jsonl(files[1], texts[30:])                # a document more in the second file
  changed = counted(c)
  assert changed.cache_path != first.cache_path
  assert np.array_equal(changed.samples([late]), windows(stream(corpus, texts), [late]))
  assert changed.tokenizer.calls == 61             # counted anew


def test_a_partly_counted_stream_is_saved_as_it_grows(corpus, monkeypatch):
  monkeypatch.setattr(text, 'SAVE_EVERY', 8)
  c = make_config(corpus, cache='partial')
  first = counted(c)
  want = first.samples([100])                    # half way into the first pass
  assert not first.done and first._saved >= 8    # pylint: disable=protected-access
  again = counted(c)
  assert np.array_equal(again.samples([100]), want) and again.tokenizer.calls < first.tokenizer.calls


def test_token_ids_beyond_the_models_vocabulary_name_the_file_and_line(corpus):
  c = make_config(corpus, cache='vocab')
  c.model.vocab_size = 100
  with pytest.raises(DataError, match=r'a.jsonl line 1: token id \d+ is beyond model.vocab_size=100'):
    text.TextSource(c).samples([0])


def test_the_text_source_needs_a_tokenizer_and_its_splits_files(corpus):
  c = make_config(corpus)
  c.data.tokenizer.type = 'none'
  with pytest.raises(DataError, match="data.tokenizer.type='none'; set data.tokenizer.type and data.tokenizer.model"):
    loader.Loader(c)
  with pytest.raises(DataError, match=r'data.text.valid is empty: .*set data.text.valid, or trainer.limit_val_batches=0'):
    loader.Loader(make_config(corpus), 'valid')
  with pytest.raises(DataError, match=r"text source \(data.source='text'\), an endless stream .* has no epochs"):
    loader.Loader(make_config(corpus)).steps_for_epochs(1)


@pytest.mark.parametrize('pattern,message', [
    ('missing.jsonl', r'missing.jsonl: no such file \(data.text.train\)'),
    ('*.jsonx', r"data.text.train: '.*\*.jsonx' matches no file"),
    ('tok.model', r'tok.model: unsupported file type \(data.text.train\); the text source reads .jsonl'),
    ('', r'text.*: a directory \(data.text.train\); give its files, or a glob like'),
])
def test_files_that_cannot_be_read_are_named(corpus, pattern, message):
  c = make_config(corpus)
  c.data.text.train = (str(corpus['root'] / pattern) if pattern else str(corpus['root']),)
  with pytest.raises(DataError, match=message):
    text.TextSource(c)


def test_a_file_without_documents_is_named_when_the_stream_reaches_it(corpus, tmp_path):
  c = make_config(corpus, cache='blank')
  (tmp_path / 'blank.jsonl').write_text('\n  \n')
  c.data.text.train = (c.data.text.train[0], str(tmp_path / 'blank.jsonl'), c.data.text.train[1])
  source = text.TextSource(c)
  source.samples([0])                             # the first file's documents are fine
  for _ in range(2):                              # asked again, it fails again (the stream never ends there)
    with pytest.raises(DataError, match=r'blank.jsonl: no documents \(empty, or blank lines only\); remove it '
                       'from data.text.train'):
      source.samples([len(stream(corpus)) // SEQ])


def test_a_run_resumed_from_its_checkpoint_trains_as_the_uninterrupted_one(corpus, tmp_path):
  import train  # pylint: disable=import-outside-toplevel

  def tiny(workdir, resume_from=None):
    c = llama_tiny.get_config('test')
    c.model.vocab_size, c.data.synthetic_vocab_size = 300, 0
    c.data.text.train = (str(corpus['root'] / 'a.jsonl'), str(corpus['root'] / 'b.parquet'))
    c.data.text.valid = (str(corpus['root'] / 'b.jsonl'),)
    c.data.tokenizer.type, c.data.tokenizer.model = 'sentencepiece', corpus['model']
    c.data.index_mapping_dir = str(tmp_path / 'counts')
    c.trainer.max_steps, c.trainer.val_check_interval = 4, 2
    c.exp_manager.create_tensorboard_logger = False
    c.exp_manager.create_checkpoint_callback = True
    c.exp_manager.checkpoint_callback_params.every_n_train_steps = 2
    c.exp_manager.resume_from_checkpoint = resume_from
    train.run(c, str(tmp_path / workdir))
    lines = (json.loads(line) for line in open(tmp_path / workdir / 'metrics.jsonl'))
    return {r['step']: r['loss'] for r in lines if 'loss' in r}

  straight = tiny('straight')
  resumed = tiny('resumed', str(tmp_path / 'straight' / 'checkpoints' / 'step_00000002'))
  assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
  assert [resumed[3], resumed[4]] == [straight[3], straight[4]]       # identical floats
