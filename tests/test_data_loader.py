"""Loader over indexed data: resume at any consumed_samples and DP degree, DP slicing,
per-document options, validation and test splits, epochs, blends, and clear errors."""
import numpy as np
import pytest
import torch

from configs import base
from data import indexed, loader, masks, tokenizer
from data.errors import DataError

EOD = 2   # </s> of the Llama-style tokenizer trained below


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A small real corpus: a SentencePiece tokenizer and text documents ending in EOD."""
  root = tmp_path_factory.mktemp('corpus')
  words = 'thou art more lovely and more temperate rough winds do shake the buds of may'.split()
  g = np.random.default_rng(0)
  texts = [' '.join(g.choice(words, size=g.integers(3, 30))) for _ in range(400)]
  (root / 'text.txt').write_text('\n'.join(texts))
  model = tokenizer.train_sentencepiece([str(root / 'text.txt')], str(root / 'tok'), 300)
  tok = tokenizer.load_tokenizer({'type': 'sentencepiece', 'model': model})
  assert tok.eod_id == EOD
  prefix = str(root / 'corpus')
  indexed.write(prefix, [tok.encode(t) + [EOD] for t in texts], np.uint16)
  return {'prefix': prefix, 'model': model, 'root': root}


def make_config(corpus, **data):
  c = base.get_config()
  c.model.vocab_size = 300
  c.data.seq_length = 16
  c.data.micro_batch_size = 2
  c.data.global_batch_size = 8
  c.data.data_prefix = (corpus['prefix'],)
  c.data.splits_string = '90,5,5'
  c.data.index_mapping_dir = str(corpus['root'] / 'maps')
  c.data.tokenizer.type = 'sentencepiece'
  c.data.tokenizer.model = corpus['model']
  for k, v in data.items():
    setattr(c.data, k, v)
  return c


def run(config, consumed, steps, dp_size=1):
  """What `steps` optimizer steps see from `consumed` on: per step, the global batch's micro
  batches of all DP ranks, rank-major (the order of the global batch)."""
  loaders = [loader.Loader(config, 'train', r, dp_size) for r in range(dp_size)]
  gbs = config.data.global_batch_size
  return [[mb for ld in loaders for mb in ld.global_batch(consumed + k * gbs)]
          for k in range(steps)]


def same(a, b):
  return all(torch.equal(x[k], y[k]) for sa, sb in zip(a, b) for x, y in zip(sa, sb) for k in x)


def test_batches_are_token_windows(corpus):
  c = make_config(corpus)
  mb = loader.Loader(c).global_batch(0)[0]
  assert mb['tokens'].shape == (2, 16) and mb['tokens'].dtype == torch.int64
  assert torch.equal(mb['tokens'][:, 1:], mb['labels'][:, :-1])
  assert torch.equal(mb['loss_mask'], torch.ones(2, 16))
  assert torch.equal(mb['position_ids'], torch.arange(16).expand(2, 16))
  assert 'segment_ids' not in mb
  assert mb['sample_ids'].tolist() == [0, 1]


@pytest.mark.parametrize('dp_after', [1, 2])
def test_resume_at_consumed_samples_continues_exactly(corpus, dp_after):
  c = make_config(corpus)
  uninterrupted = run(c, 0, 6)
  resumed = run(c, 3 * 8, 3, dp_size=dp_after)
  assert same(uninterrupted[3:], resumed)


def test_resume_across_epochs(corpus):
  c = make_config(corpus)
  n = loader.Loader(c).num_samples
  start = (n // 8 - 1) * 8          # the last steps of epoch 0 and the first of epoch 1
  assert same(run(c, start, 3)[1:], run(c, start + 8, 2, dp_size=2))


def test_each_sample_of_a_global_batch_goes_to_exactly_one_rank(corpus):
  c = make_config(corpus)
  taken = [int(i) for r in range(4) for mb in loader.Loader(c, 'train', r, 4).global_batch(40)
           for i in mb['sample_ids']]
  assert sorted(taken) == list(range(40, 48))
  one = torch.cat([mb['tokens'] for mb in loader.Loader(c).global_batch(40)])
  four = torch.cat([mb['tokens'] for r in range(4)
                    for mb in loader.Loader(c, 'train', r, 4).global_batch(40)])
  assert torch.equal(one, four)


def test_validation_reads_only_the_valid_split(corpus):
  c = make_config(corpus)
  ds = indexed.IndexedDataset(corpus['prefix'])
  valid = loader.Loader(c, 'valid')
  assert valid.source.doc_range == (360, 380)
  epoch = valid.source.epoch(0)
  assert sorted(epoch['doc_idx'].tolist()) == list(range(360, 380))
  stream = np.concatenate([ds[d] for d in epoch['doc_idx']])
  assert valid.num_samples == (len(stream) - 1) // 16
  mb = valid.global_batch(0)[0]
  for row, j in enumerate(epoch['shuffle_idx'][:2]):
    window = torch.cat([mb['tokens'][row], mb['labels'][row, -1:]])
    assert window.tolist() == stream[j * 16:j * 16 + 17].tolist()


def test_document_options_follow_eod_tokens(corpus):
  c = make_config(corpus, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
  for mb in loader.Loader(c).global_batch(0):
    for row in range(2):
      tokens = mb['tokens'][row].tolist()
      seg, pos = mb['segment_ids'][row].tolist(), mb['position_ids'][row].tolist()
      doc, start = 0, 0
      for i, t in enumerate(tokens):
        assert seg[i] == doc and pos[i] == i - start
        assert mb['loss_mask'][row, i] == (0.0 if t == EOD else 1.0)
        if t == EOD:
          doc, start = doc + 1, i + 1


def test_document_fields_by_hand():
  tokens = np.array([[7, 2, 5, 6, 2, 2, 9]])
  f = masks.document_fields(tokens, 2, eod_mask_loss=True, reset_position_ids=True,
                            reset_attention_mask=True)
  assert f['segment_ids'].tolist() == [[0, 0, 1, 1, 1, 2, 3]]
  assert f['position_ids'].tolist() == [[0, 1, 0, 1, 2, 0, 0]]
  assert f['loss_mask'].tolist() == [[1, 0, 1, 1, 0, 0, 1]]
  plain = masks.document_fields(tokens, 2, reset_attention_mask=True)
  assert plain['position_ids'].tolist() == [list(range(7))] and plain['loss_mask'].all()


def test_blend_through_the_config(corpus, tmp_path):
  other = str(tmp_path / 'other')
  indexed.write(other, [[299] * 50] * 40, np.uint16)      # recognizable: one token only
  c = make_config(corpus, data_prefix=(0.75, corpus['prefix'], 0.25, other))
  ld = loader.Loader(c)
  tokens = torch.cat([mb['tokens'] for k in range(50) for mb in ld.global_batch(8 * k)])
  from_other = (tokens == 299).all(dim=1).float().mean().item()
  assert from_other == pytest.approx(0.25, abs=0.01)


def test_token_beyond_model_vocab_names_the_file(corpus):
  c = make_config(corpus)
  c.model.vocab_size = 50
  with pytest.raises(DataError, match=r'corpus.bin: token id \d+ outside .*vocab_size 50'):
    loader.Loader(c).global_batch(0)


def test_document_options_need_a_tokenizer(corpus):
  c = make_config(corpus, eod_mask_loss=True)
  c.data.tokenizer.type = 'none'
  with pytest.raises(DataError, match='set data.tokenizer'):
    loader.Loader(c)


def test_synthetic_stream_when_no_prefix(corpus):
  c = make_config(corpus, data_prefix=())
  ld = loader.Loader(c)
  assert ld.num_samples is None
  assert ld.global_batch(0)[0]['tokens'].shape == (2, 16)
  with pytest.raises(DataError, match='the synthetic stream .* has no epochs'):
    ld.steps_for_epochs(1)


def test_an_epoch_is_one_pass_over_the_split_and_ends_on_the_step_completing_it(corpus):
  train = loader.Loader(make_config(corpus), 'train')
  n = train.num_samples
  assert n == train.source.samples_per_epoch and n % 8      # epochs end inside global batches
  ends = [-(-e * n // 8) for e in (1, 2, 3)]                 # the steps whose batches complete them
  assert [train.steps_for_epochs(e) for e in (1, 2, 3)] == ends
  steps = range(1, ends[-1] + 1)
  assert [k for k in steps if train.crosses_epochs((k - 1) * 8, k * 8, 1)] == ends
  assert [k for k in steps if train.crosses_epochs((k - 1) * 8, k * 8, 2)] == ends[1:2]


def test_the_test_split_is_the_third_part_and_an_empty_one_is_an_error(corpus):
  test = loader.Loader(make_config(corpus), 'test')
  assert test.source.doc_range == (380, 400) and test.num_samples > 0
  with pytest.raises(DataError, match=r"the test split \(splits_string '90,10,0'\) holds 0 of 400 documents"):
    loader.Loader(make_config(corpus, splits_string='90,10,0'), 'test')
