"""Preference pairs (DPO/ORPO): every record form, the masks of each side, two segments per row,
trl's prompt truncation, bad records, and the source the loader calls."""
import json
import os

import numpy as np
import pytest
import torch

from configs import base
from data import loader, preference
from data.errors import DataError
from model import transformer
from tests.test_chat import SMOL, SPECIALS, theirs
from tests.test_sft import tiny_model, tok, tok_dir, write_jsonl  # pylint: disable=unused-import
from tests.test_sft_records import saved_formats

TEXT = [{'prompt': 'What is the capital of France?', 'chosen': ' Paris.', 'rejected': ' Rome.'},
        {'prompt': 'Hello!', 'chosen': ' Hello! How are you today?', 'rejected': ''}]
TOKENS = [{'prompt_input_ids': [5, 6, 7], 'chosen_input_ids': [8, 9], 'rejected_input_ids': [10]}]
CHAT = [{'prompt': [{'role': 'system', 'content': 'You are a helpful assistant.'},
                    {'role': 'user', 'content': 'Numbers like 12345?'}],
         'chosen': [{'role': 'assistant', 'content': 'And 3.14.'}],
         'rejected': [{'role': 'assistant', 'content': 'The quick brown fox.'}]}]


def pairs_of(dicts, tok):
  records = [preference.Record(f'test record {i}', d) for i, d in enumerate(dicts)]
  return preference.tokenize(records, tok, SMOL, SPECIALS)


def ids(pair):
  return [x.tolist() for x in pair[:3]]


# --- records -----------------------------------------------------------------------


def test_text_pairs_are_bos_prompt_then_response_and_eos(tok):
  got = pairs_of(TEXT, tok)
  for pair, record in zip(got, TEXT):
    assert ids(pair) == [[tok.bos_id] + tok.encode(record['prompt']),
                         tok.encode(record['chosen']) + [tok.eos_id],
                         tok.encode(record['rejected']) + [tok.eos_id]]
  assert ids(got[1])[2] == [tok.eos_id]                                  # empty response: eos


def test_chat_pairs_are_apply_chat_template_prefixwise(tok, tok_dir):
  hf = theirs(tok_dir, SMOL)

  def hf_ids(messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out['input_ids'] if isinstance(out, dict) or hasattr(out, 'keys') else out)

  (prompt, chosen, rejected, _), = pairs_of(CHAT, tok)
  record = CHAT[0]
  assert prompt.tolist() == hf_ids(record['prompt'], add_generation_prompt=True)
  for response, key in ((chosen, 'chosen'), (rejected, 'rejected')):
    full = hf_ids(record['prompt'] + record[key])
    n = len(prompt) + len(response)
    assert full[:n] == prompt.tolist() + response.tolist()
    assert tok.decode(response) == record[key][0]['content'] + '<|im_end|>'
    assert tok.decode(full[n:]) == '\n'            # only the newline after the turn is left out


def test_pretokenized_pairs_are_taken_as_they_are(tok):
  assert ids(pairs_of(TOKENS, None)[0]) == [[5, 6, 7], [8, 9], [10]]


def test_every_format_reads_the_same_pairs(tmp_path, tok):
  rows = TEXT + TOKENS + TEXT[:1]
  want = [ids(p) for p in pairs_of(rows, tok)]
  for name, path in saved_formats(tmp_path, rows).items():
    got = preference.tokenize(preference.read_pairs(path), tok, SMOL, SPECIALS)
    assert [ids(p) for p in got] == want, name
  chat_file = write_jsonl(tmp_path / 'chat.jsonl', CHAT)
  assert ids(preference.tokenize(preference.read_pairs(chat_file), tok, SMOL, SPECIALS)[0]) == \
      ids(pairs_of(CHAT, tok)[0])


@pytest.mark.parametrize('line, message', [
    ('{"prompt": "a", "chosen": "b"}', r'"rejected" missing'),
    ('{"prompt": "a", "chosen": "b", "rejected": 3}', r'must be all strings or all lists.*int'),
    ('{"prompt": "a", "chosen": [], "rejected": "c"}', r'"chosen" list'),
    ('{"prompt": "a", "chosen": "b", "rejected": "c"', r'not valid JSON'),
    ('["a", "b"]', r'expected a JSON object, got list; a preference record needs'),
    ('{"input": "a", "output": "b"}', r'a preference record needs .*keys \[\'input\''),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],'
     ' "rejected": [{"role": "assistant", "content": "c"}]}', r'"chosen" has no assistant'),
    ('{"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "b"}],'
     ' "rejected": [{"role": "assistant", "content": "c"}]}', r'prompt\[0\] needs a string'),
    ('{"prompt_input_ids": [1], "chosen_input_ids": [2]}', r'"rejected_input_ids" must be a list'),
    ('{"prompt_input_ids": [1], "chosen_input_ids": [-2], "rejected_input_ids": [3]}',
     r'"chosen_input_ids" must be token ids >= 0'),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
  path = write_jsonl(tmp_path / 'bad.jsonl', [TEXT[0], '', line])     # line 2 is blank
  with pytest.raises(DataError, match=f'bad.jsonl line 3: .*{message}'):
    preference.read_pairs(path)


def test_chat_responses_must_extend_the_prompt(tok):
  last_only = "{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}"
  record = preference.Record('f line 9', CHAT[0])
  with pytest.raises(DataError, match='f line 9: .*do not extend'):
    preference.tokenize([record], tok, last_only, SPECIALS)


# --- rows --------------------------------------------------------------------------

PAIR = preference.Pair(np.arange(1, 4), np.arange(11, 15), np.arange(21, 24), 'p')  # 3, 4, 3


def test_a_row_is_prompt_chosen_then_prompt_rejected_with_masks_of_each_response():
  rows = preference.PairRows([PAIR], 16, max_prompt_length=8, truncation_mode='keep_end')
  row = rows.row(0)
  assert set(row) == {'tokens', 'labels', 'position_ids', 'segment_ids', 'chosen_mask',
                      'rejected_mask', 'loss_mask'}
  assert all(v.shape == (16,) for v in row.values())
  full = np.append(row['tokens'], row['labels'][-1])
  assert full.tolist() == [1, 2, 3, 11, 12, 13, 14, 1, 2, 3, 21, 22, 23] + [0] * 4
  assert row['segment_ids'].tolist() == [0] * 7 + [1] * 6 + [2] * 3
  assert row['position_ids'].tolist() == list(range(7)) + list(range(6)) + list(range(3))
  for key, response in (('chosen_mask', PAIR.chosen), ('rejected_mask', PAIR.rejected)):
    assert row[key].dtype == np.float32
    assert row['labels'][row[key] == 1].tolist() == response.tolist()   # exactly the response
  assert row['chosen_mask'][6] == 0 and row['rejected_mask'][12] == 0   # no label crosses
  assert np.array_equal(row['loss_mask'], row['chosen_mask'])
  assert rows.truncation == preference.Truncation(0, 0, 1, 0)


def test_the_sides_never_see_each_other(tok):
  m = tiny_model(64)
  params = transformer.init(m, seed=3)
  both = preference.PairRows([PAIR], 24, 8, 'keep_end').batch([0])
  alone = preference.PairRows([PAIR._replace(chosen=np.arange(40, 48))], 24, 8, 'keep_end')
  alone = alone.batch([0])                  # another chosen: the rejected side must not change
  with torch.no_grad():
    logits = [transformer.stage(params, {k: torch.from_numpy(v) for k, v in b.items()}, m,
                                objective=None) for b in (both, alone)]
  side = lambda b: b['segment_ids'][0] == 1
  torch.testing.assert_close(logits[0][0][side(both)], logits[1][0][side(alone)])
  assert (logits[0][0][:7] - logits[1][0][:7]).abs().max() > 1e-3    # the chosen side did


@pytest.mark.parametrize('mode, kept', [('keep_end', [6, 7, 8, 9]), ('keep_start', [0, 1, 2, 3])])
def test_prompts_are_cut_first_as_trl_does(mode, kept):
  pair = preference.Pair(np.arange(10), np.arange(50, 53), np.arange(60, 62), 'p')
  fitted = preference.fit(pair, 15, max_prompt_length=4, truncation_mode=mode)
  assert ids(fitted) == [kept, [50, 51, 52], [60, 61]]
  assert ids(preference.fit(pair, 30, 4, mode)) == ids(pair)                 # fits: untouched
  rows = preference.PairRows([pair, pair], 15, 4, mode)
  assert rows.truncation == preference.Truncation(2, 0, 2, 24)


def test_long_responses_keep_their_start_and_are_counted():
  pair = preference.Pair(np.arange(10), np.arange(50, 70), np.arange(80, 83), 'p')
  fitted = preference.fit(pair, 15, 4, 'keep_end')        # room 16 - 2 * 4 = 8 for responses
  assert ids(fitted)[1:] == [list(range(50, 55)), [80, 81, 82]]   # the short one is kept
  both_long = pair._replace(rejected=np.arange(80, 100))
  assert ids(preference.fit(both_long, 15, 4, 'keep_end'))[1:] == [
      list(range(50, 54)), list(range(80, 84))]                  # half the room each
  stats = preference.PairRows([pair, both_long, PAIR], 15, 4, 'keep_end').truncation
  assert stats == preference.Truncation(2, 2, 3, (12 + 15) + (12 + 32))
  assert str(stats) == 'cut the prompt of 2 and the responses of 2 of 3 pairs (71 tokens cut)'
  with pytest.raises(DataError, match='p: a prompt of 8 tokens.*lower max_prompt_length'):
    preference.fit(pair, 15, 8, 'keep_end')


# --- settings, source and loader -----------------------------------------------------


def pair_config(tok_dir, train_dir, objective='dpo', **overrides):
  c = base.get_config()
  c.model.objective = objective
  c.data.seq_length = 96
  c.data.tokenizer.type = 'huggingface'
  c.data.tokenizer.model = os.path.join(tok_dir, 'tokenizer.json')
  c.model.vocab_size = 512
  c.data.train_dir, c.data.val_dir = train_dir, train_dir
  c.data.micro_batch_size, c.data.global_batch_size = 2, 4
  c.update_from_flattened_dict(overrides)
  return c


def test_settings_come_from_the_objectives_section(tok_dir):
  c = pair_config(tok_dir, 'x', **{'model_alignment_strategy.orpo.max_prompt_length': 9,
                                   'model_alignment_strategy.orpo.truncation_mode': 'keep_start'})
  assert (preference.settings(c)['max_prompt_length'], preference.settings(c)[
      'truncation_mode']) == (64, 'keep_end')
  c.model.objective = 'orpo'
  assert (preference.settings(c)['max_prompt_length'], preference.settings(c)[
      'truncation_mode']) == (9, 'keep_start')
  c.model_alignment_strategy.orpo.truncation_mode = 'middle'
  with pytest.raises(DataError, match='orpo.truncation_mode'):
    preference.settings(c)
  with pytest.raises(DataError, match='not .next_token'):
    preference.settings(base.get_config())


def test_source_micro_batches_and_keyed_order(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / 'pairs.jsonl', (TEXT + CHAT + TOKENS) * 3)
  source = preference.PreferenceSource(pair_config(tok_dir, path), 'train')
  n = source.samples_per_epoch
  assert n == 12 and source.summary().startswith(f'DPO train: 12 preference pairs from {path}')
  batch = source.micro_batch(np.arange(3))
  assert set(batch) == {'tokens', 'labels', 'position_ids', 'segment_ids', 'chosen_mask',
                        'rejected_mask', 'loss_mask', 'sample_ids'}
  assert all(v.shape == (3, 96) for k, v in batch.items() if k != 'sample_ids')
  assert batch['chosen_mask'].dtype == torch.float32 and batch['tokens'].dtype == torch.int64
  epoch0, epoch1 = source.row_ids(np.arange(n)), source.row_ids(np.arange(n, 2 * n))
  assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and not np.array_equal(epoch0, epoch1)
  again = preference.PreferenceSource(pair_config(tok_dir, path), 'train')
  assert np.array_equal(again.row_ids(np.arange(2 * n)), np.concatenate([epoch0, epoch1]))
  valid = preference.PreferenceSource(pair_config(tok_dir, path), 'valid')
  assert not np.array_equal(valid.row_ids(np.arange(n)), epoch0)
  row = source.rows.row(int(epoch0[0]))
  assert all(np.array_equal(batch[k][0].numpy(), row[k]) for k in row)
  few = pair_config(tok_dir, path, 'orpo', **{'data.dev_choose_samples': 2})
  assert preference.PreferenceSource(few).summary().startswith('ORPO train: 2 preference pairs')


def test_the_loader_takes_pairs_for_dpo_and_orpo(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / 'pairs.jsonl', TEXT * 4)
  for objective in ('dpo', 'orpo'):
    data = loader.Loader(pair_config(tok_dir, path, objective))
    assert data.sft and isinstance(data.source, preference.PreferenceSource)
    assert data.num_samples == 8 and 'preference pairs' in data.source.summary()
    micro = data.global_batch(0)
    assert len(micro) == 2 and micro[0]['rejected_mask'].shape == (2, 96)
  with pytest.raises(DataError, match='model.objective=dpo.*data.train_dir'):
    loader.Loader(pair_config(tok_dir, None))
  with pytest.raises(DataError, match='beyond model.vocab_size'):
    loader.Loader(pair_config(tok_dir, path, **{'model.vocab_size': 100}))
  with pytest.raises(DataError, match='pairs.jsonl line 1: .*a preference record needs'):
    loader.Loader(pair_config(tok_dir, write_jsonl(tmp_path / 'pairs.jsonl', [{'input': 'a'}])))
