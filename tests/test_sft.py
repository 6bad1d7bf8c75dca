"""SFT data: examples and their masks, packing, and the key property: a packed batch trains
exactly what its examples train one per row (reading records: tests/test_sft_records.py)."""
import json
import os

import numpy as np
import pytest
import torch

from configs import base
from data import chat, sft, tokenizer
from data.errors import DataError
from model import layers, transformer
from tests.test_chat import SMOL, SPECIALS, tokenizer_dir

PROMPTS = [
    {'input': 'What is the capital of France?', 'output': ' Paris is.'},
    {'input': 'Write a short poem about the sea.', 'output': ' The sea and the sky,\nblue.'},
    {'input': 'Hello!', 'output': ''},
]
CHATS = [
    {'messages': [{'role': 'user', 'content': 'Hello! How are you today?'},
                  {'role': 'assistant', 'content': 'I am fine, thank you.'}]},
    {'messages': [{'role': 'system', 'content': 'You are a helpful assistant.'},
                  {'role': 'user', 'content': 'Numbers like 12345?'},
                  {'role': 'assistant', 'content': 'And 3.14.'},
                  {'role': 'user', 'content': 'And you?'},
                  {'role': 'assistant', 'content': 'The quick brown fox.'}]},
]
MIXED = [PROMPTS[0], CHATS[0], PROMPTS[1], CHATS[1], PROMPTS[2]]


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
  return tokenizer_dir(tmp_path_factory.mktemp('tok'), template=SMOL)


@pytest.fixture(scope='module')
def tok(tok_dir):
  return tokenizer.HuggingFaceTokenizer(os.path.join(tok_dir, 'tokenizer.json'))


def examples_of(dicts, tok):
  records = [sft.Record(f'test record {i}', d) for i, d in enumerate(dicts)]
  return sft.tokenize(records, tok, SMOL, SPECIALS)


def write_jsonl(path, rows):
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows)
  return str(path)


# --- examples ----------------------------------------------------------------------


def test_input_output_is_bos_input_output_eos_with_loss_on_output_and_eos(tok):
  (ids, target), = examples_of(PROMPTS[:1], tok)
  head = [tok.bos_id] + tok.encode(PROMPTS[0]['input'])
  tail = tok.encode(PROMPTS[0]['output']) + [tok.eos_id]
  assert ids.tolist() == head + tail
  assert target.tolist() == [0] * len(head) + [1] * len(tail)
  (ids, target), = examples_of(PROMPTS[2:], tok)                 # empty output: only eos
  assert target.tolist()[-2:] == [0, 1] and ids[-1] == tok.eos_id


def test_chat_records_take_the_chat_mask(tok):
  (ids, target), = examples_of(CHATS[1:], tok)
  want_ids, want_mask = chat.encode_chat(tok, SMOL, CHATS[1]['messages'], **SPECIALS)
  assert ids.tolist() == want_ids.tolist() and target.tolist() == want_mask.tolist()
  assert tok.decode(ids[target == 1]) == 'And 3.14.<|im_end|>The quick brown fox.<|im_end|>'


def test_pretokenized_records_are_taken_as_they_are(tok):
  ids = [5, 6, 7, 8]
  by_mask = sft.Record('t', {'input_ids': ids, 'loss_mask': [0, 0, 1, 1]})
  by_labels = sft.Record('t', {'input_ids': ids, 'labels': [-100, -100, 7, 8]})
  for ids_out, target in sft.tokenize([by_mask, by_labels], None):
    assert ids_out.tolist() == ids and target.tolist() == [0, 0, 1, 1]


# --- rows --------------------------------------------------------------------------


def fake_examples(lengths, seed=0):
  """Token ids 1.. and a prompt (0) / target (1) split: the first third of each is prompt."""
  g = np.random.default_rng(seed)
  out = []
  for n in lengths:
    target = (np.arange(n) >= n // 3).astype(np.int8)
    out.append((g.integers(1, 50, n).astype(np.int64), target))
  return out


def test_truncation_keeps_the_start_and_counts():
  examples = fake_examples([5, 9, 12, 3])
  cut, stats = sft.truncate(examples, seq_length=8)
  assert [len(ids) for ids, _ in cut] == [5, 9, 9, 3]
  assert cut[2][0].tolist() == examples[2][0][:9].tolist()
  assert stats == sft.Truncation(truncated=1, examples=4, tokens_cut=3)
  assert str(stats) == 'truncated 1 of 4 examples (3 tokens cut)'
  assert sft.Rows(examples, 8).truncation == stats


def test_next_fit_packing_in_order():
  assert sft.pack([4, 3, 2, 6, 4, 1], capacity=9).tolist() == [0, 3, 4, 6]
  assert sft.pack([9, 9], capacity=9).tolist() == [0, 1, 2]
  assert sft.pack([4, 3], capacity=9, packing=False).tolist() == [0, 1, 2]
  assert sft.pack([], capacity=9).tolist() == [0]


@pytest.mark.parametrize('packing', [True, False])
def test_row_invariants(packing):
  seq = 16
  examples = fake_examples([5, 9, 17, 3, 12, 2, 7, 20, 4], seed=1)
  rows = sft.Rows(examples, seq, packing=packing, pad_id=0)
  cut, _ = sft.truncate(examples, seq)
  assert len(rows) == (6 if packing else len(examples))   # [5 9] [17] [3 12 2] [7] [17] [4]
  seen = []
  for r in range(len(rows)):
    row, members = rows.row(r), rows.examples_in(r)
    assert all(v.shape == (seq,) for v in row.values())
    assert row['loss_mask'].dtype == np.float32 and row['tokens'].dtype == np.int64
    full = np.append(row['tokens'], row['labels'][-1])          # the row's seq + 1 tokens
    assert np.array_equal(row['labels'], full[1:])
    at = 0
    for k, e in enumerate(members):
      ids, target = cut[e]
      n = len(ids)
      assert np.array_equal(full[at:at + n], ids)
      inputs = slice(at, min(at + n, seq))                         # positions fed to the model
      assert (row['segment_ids'][inputs] == k).all()
      assert np.array_equal(row['position_ids'][inputs], np.arange(inputs.stop - at))
      if at + n - 1 < seq:                                        # A's last token -> B's first
        assert row['loss_mask'][at + n - 1] == 0
      # Each target token (but the first token, which nothing predicts) is a trained label.
      trained = row['loss_mask'][at:at + n - 1]
      assert np.array_equal(trained, target[1:])
      seen += [(e, j) for j in np.flatnonzero(trained) + 1]
      at += n
    pad = slice(at, seq)
    assert (row['loss_mask'][pad] == 0).all() and (row['tokens'][pad] == 0).all()
    assert (row['segment_ids'][pad] == len(members)).all()       # its own segment
  every = [(e, j) for e, (_, t) in enumerate(cut) for j in np.flatnonzero(t[1:]) + 1]
  assert sorted(seen) == sorted(every) and len(seen) == len(set(seen))  # each exactly once


# --- packed = one by one -----------------------------------------------------------


def tiny_model(vocab):
  m = base.get_config().model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 32, 48
  m.num_attention_heads, m.num_kv_heads, m.vocab_size = 4, 2, vocab
  m.max_position_embeddings = 64
  return m


def per_example_losses(params, rows, m, drop_segments=False):
  """{example index: summed loss of its trained tokens}, and the sum over the batch."""
  batch = {k: torch.from_numpy(v) for k, v in rows.batch(range(len(rows))).items()}
  if drop_segments:
    del batch['segment_ids']
  logits = transformer.stage(params, batch, m, objective=None)
  token_loss = layers.LOCAL_OPS.cross_entropy(logits, batch['labels'], m.vocab_size)
  token_loss = token_loss * batch['loss_mask']
  losses = {}
  for r in range(len(rows)):
    for k, e in enumerate(rows.examples_in(r)):
      losses[int(e)] = token_loss[r][rows.row(r)['segment_ids'] == k].sum()
  return losses, token_loss.sum()


def test_packed_rows_give_the_losses_and_gradients_of_examples_one_by_one(tok):
  m = tiny_model(tok.vocab_size)
  seq = 96
  long = {'input': 'Hello!', 'output': ' The quick brown fox jumps over the lazy dog.' * 20}
  examples = examples_of(MIXED * 3 + [long], tok)       # long: truncated, a full row alone
  packed = sft.Rows(examples, seq, packing=True, pad_id=tok.eos_id)
  alone = sft.Rows(examples, seq, packing=False, pad_id=tok.eos_id)
  assert len(packed) < len(alone) == len(examples)
  assert packed.truncation.truncated == 1
  assert max(len(packed.examples_in(r)) for r in range(len(packed))) >= 3

  count = sum(int(t[1:].sum()) for _, t in sft.truncate(examples, seq)[0])
  for rows in (packed, alone):
    assert rows.batch(range(len(rows)))['loss_mask'].sum() == count
  grads = []
  for rows in (packed, alone):
    params = {k: v.requires_grad_() for k, v in transformer.init(m, seed=3).items()}
    losses, total = per_example_losses(params, rows, m)
    # Divided by the trained-token count, as the loop divides its loss sums: the same number
    # for both layouts, and it keeps fp32 rounding of the ~700-token sum under 1e-6.
    (total / count).backward()
    grads.append({k: v.grad for k, v in params.items()})
    if rows is packed:
      packed_losses = losses
  assert sorted(packed_losses) == sorted(losses) == list(range(len(examples)))
  for e in losses:
    assert losses[e].item() > 0
    torch.testing.assert_close(packed_losses[e], losses[e], atol=1e-5, rtol=1e-6)
  for k in grads[0]:
    torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=0, msg=k)

  # The test has teeth: without segment_ids packed examples see each other and losses move.
  with torch.no_grad():
    params = transformer.init(m, seed=3)
    leaky, _ = per_example_losses(params, packed, m, drop_segments=True)
    fair, _ = per_example_losses(params, packed, m)
  assert any(abs(leaky[e] - fair[e]) > 1e-3 for e in fair)


# --- the source the loader calls ---------------------------------------------------


def sft_config(tok_dir, train_dir, **overrides):
  c = base.get_config()
  c.data.seq_length = 32
  c.data.tokenizer.type = 'huggingface'
  c.data.tokenizer.model = os.path.join(tok_dir, 'tokenizer.json')
  c.model.vocab_size = 512
  c.data.train_dir, c.data.val_dir, c.data.dev_choose_samples = train_dir, train_dir, None
  c.model_alignment_strategy.sft.packing = True
  c.update_from_flattened_dict(overrides)
  return c


def test_settings_defaults():
  s = sft.settings(base.get_config())
  assert (s['train_dir'], s['val_dir'], s['dev_choose_samples'], s['packing']) == (
      None, None, None, True)


def test_source_micro_batches(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / 'train.jsonl', MIXED * 4)
  source = sft.SFTSource(sft_config(tok_dir, path), 'train')
  n = source.samples_per_epoch
  assert source.truncation.examples == 20 and 'truncated' in source.summary()
  batch = source.micro_batch(np.arange(3))
  assert set(batch) == {'tokens', 'labels', 'loss_mask', 'position_ids', 'segment_ids',
                        'sample_ids'}
  assert all(v.shape == (3, 32) for k, v in batch.items() if k != 'sample_ids')
  assert batch['loss_mask'].dtype == torch.float32 and batch['tokens'].dtype == torch.int64
  assert batch['sample_ids'].tolist() == [0, 1, 2]
  # Each epoch visits every row once, in an order keyed by (seed, split, epoch).
  epoch0, epoch1 = source.row_ids(np.arange(n)), source.row_ids(np.arange(n, 2 * n))
  assert sorted(epoch0) == sorted(epoch1) == list(range(n))
  assert not np.array_equal(epoch0, epoch1)
  again = sft.SFTSource(sft_config(tok_dir, path), 'train')
  assert np.array_equal(again.row_ids(np.arange(2 * n)), np.concatenate([epoch0, epoch1]))
  assert not np.array_equal(sft.SFTSource(sft_config(tok_dir, path), 'valid').row_ids(
      np.arange(n)), epoch0)
  row = source.rows.row(int(epoch0[0]))
  assert all(np.array_equal(batch[k][0].numpy(), row[k]) for k in row)


def test_source_options(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / 'train.jsonl', MIXED * 4)
  unpacked = sft.SFTSource(sft_config(
      tok_dir, path, **{'model_alignment_strategy.sft.packing': False}), 'train')
  assert unpacked.samples_per_epoch == 20
  few = sft.SFTSource(sft_config(tok_dir, path, **{'data.dev_choose_samples': 3}), 'train')
  assert few.truncation.examples == 3
  with pytest.raises(DataError, match='beyond model.vocab_size'):
    sft.SFTSource(sft_config(tok_dir, path, **{'model.vocab_size': 100}), 'train')
  with pytest.raises(DataError, match='data.train_dir'):
    sft.SFTSource(sft_config(tok_dir, None), 'train')


# --- the loop: SFT at every layout equals one device ---------------------------------


@pytest.fixture(scope='module')
def pretokenized_dir(tmp_path_factory):
  """Pre-tokenized records of 3-24 tokens (seq_length 16: some are truncated, most packed
  several to a row) whose loss falls on a response after a prompt of varying length."""
  generator = np.random.default_rng(7)
  rows = []
  for _ in range(48):
    n = int(generator.integers(3, 25))
    prompt = int(generator.integers(1, n))
    rows.append({'input_ids': generator.integers(0, 32, n).tolist(),
                 'loss_mask': [0] * prompt + [1] * (n - prompt)})
  return write_jsonl(tmp_path_factory.mktemp('sft') / 'records.jsonl', rows)


SFT_LAYOUTS = {
    'sft_tp2': (2, {'tp': 2}),
    'sft_pp2': (2, {'pp': 2}),
    'sft_dp2_zero1': (2, {'zero1': True}),
    'sft_tp2_mistral': (2, {'tp': 2, 'family': 'mistral'}),   # sliding window inside packed documents
}


def test_sft_at_every_layout_trains_like_one_device(pretokenized_dir, tmp_path, tmp_path_factory):
  """Packed rows with masked prompts: the global batch's loss is the mean over its response
  tokens, however they fall over micro batches, DP ranks and pipeline stages (every layout,
  one after another in one spawned world: all are 2 ranks)."""
  from tests import parity    # pylint: disable=import-outside-toplevel
  layouts = {name: (world_size, dict(kwargs, sft=pretokenized_dir)) for name, (world_size, kwargs) in SFT_LAYOUTS.items()}
  parity.check_layouts(layouts, tmp_path, tmp_path_factory)
