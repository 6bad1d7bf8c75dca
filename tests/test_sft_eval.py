"""tools/sft_eval.py: the scores against hand-computed values and the libraries themselves,
prompts and references taken from both record forms, an end-to-end run whose replies are
tools/generate.py's, and bad input named by file and line."""
import json
import math
import sys

import pytest

from data.errors import DataError
from tests import procs
from tests.test_generate_tool import model_dir  # noqa: F401  pylint: disable=unused-import  (the tiny HF model)
from tools import sft_eval

rouge_scorer = pytest.importorskip('rouge_score.rouge_scorer')
sacrebleu = pytest.importorskip('sacrebleu')

CHAT = {'messages': [{'role': 'system', 'content': 'You are a helpful assistant.'},
                     {'role': 'user', 'content': 'What is the capital of France?'},
                     {'role': 'assistant', 'content': 'Paris.'},
                     {'role': 'user', 'content': 'Write a short poem about the sea.'},
                     {'role': 'assistant', 'content': 'The sea and the sky.'},
                     {'role': 'user', 'content': 'Thank you!'}]}     # after the last reply: dropped
PROMPT = {'input': 'The quick brown fox', 'output': ' jumps over the lazy dog.'}


def write(path, *records):
  path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in records))
  return str(path)


# ---- scores

def test_exact_match_strips_and_averages():
  assert sft_eval.exact_matches([' Paris. ', 'London', ''], ['Paris.\n', 'Paris', ' ']) == [True, False, True]
  assert sft_eval.score([' Paris. ', 'London'], ['Paris.', 'Paris'])['exact_match'] == 0.5


def test_rouge_l_by_hand():
  # LCS "the cat on the mat": 5 of 6 tokens each way, so P = R = F = 5/6.
  assert sft_eval.rouge_l(['the cat lay on the mat'], ['the cat sat on the mat']) == [pytest.approx(5 / 6)]
  # The reference whole in a reply twice its length: P = 1/2, R = 1, F = 2/3.
  assert sft_eval.rouge_l(['the cat sat on the mat'], ['the cat sat']) == [pytest.approx(2 / 3)]
  # Stemmed: "cats sitting" matches "cat sits".
  assert sft_eval.rouge_l(['Cats sitting.'], ['the cat sits']) == [pytest.approx(0.8)]
  assert sft_eval.rouge_l(['alpha beta'], ['gamma delta']) == [0.0]


def test_bleu_by_hand():
  same = ['the cat sat on the mat today', 'a bird sang in the old tree']
  assert sft_eval.corpus_bleu(same, same) == pytest.approx(100)
  assert sft_eval.corpus_bleu(['alpha beta gamma delta epsilon'], ['one two three four five']) == 0
  # n-gram precisions 6/6, 4/5, 3/4, 2/3; brevity penalty exp(1 - 7/6).
  expected = 100 * (1 * 0.8 * 0.75 * 2 / 3) ** 0.25 * math.exp(1 - 7 / 6)
  assert sft_eval.corpus_bleu(['the cat sat on the mat'], ['the cat sat on the red mat']) == pytest.approx(expected)


def test_scores_equal_the_libraries():
  replies = ['The sea and the sky are blue.', 'Paris is the capital.', 'I do not know', '']
  refs = ['The sky and the sea were blue today.', 'Paris.', 'I really do not know that.', 'Nothing.']
  scores = sft_eval.score(replies, refs)
  scorer = rouge_scorer.RougeScorer(['rougeL'], use_stemmer=True)
  theirs = [scorer.score(ref, r)['rougeL'].fmeasure for r, ref in zip(replies, refs)]
  assert scores['rougeL_each'] == pytest.approx(theirs) and scores['rougeL'] == pytest.approx(sum(theirs) / 4)
  assert scores['bleu'] == pytest.approx(sacrebleu.corpus_bleu(replies, [refs]).score)
  assert scores['count'] == 4 and scores['exact'] == [False] * 4


def test_scores_refuse_unpaired_or_empty_lists():
  with pytest.raises(ValueError, match='2 replies for 1 references'):
    sft_eval.score(['a', 'b'], ['a'])
  with pytest.raises(ValueError, match='nothing to score'):
    sft_eval.score([], [])


def test_a_missing_library_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'sacrebleu', None)     # import sacrebleu now raises ImportError
  with pytest.raises(sft_eval.MissingLibrary, match='pip install rouge-score sacrebleu'):
    sft_eval.corpus_bleu(['a'], ['a'])


# ---- records

def test_prompt_and_reference_of_each_record_form(tmp_path):
  chat, prompt = sft_eval.read_examples(write(tmp_path / 'd.jsonl', CHAT, PROMPT))
  assert chat.is_chat and chat.prompt == CHAT['messages'][:4] and chat.reference == 'The sea and the sky.'
  assert not prompt.is_chat and prompt.prompt == PROMPT['input'] and prompt.reference == PROMPT['output']
  assert chat.where.endswith('d.jsonl line 1')
  assert len(sft_eval.read_examples(write(tmp_path / 'e.jsonl', CHAT, PROMPT, CHAT), limit=2)) == 2


@pytest.mark.parametrize('record, message', [
    ({'messages': [{'role': 'user', 'content': 'hi'}]}, 'no assistant message'),
    ({'messages': [{'role': 'assistant', 'content': 'hi'}]}, 'nothing prompts it'),
    ({'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None,
                                                       'tool_calls': [{'name': 'f'}]}]}, 'no text content'),
    ({'input': 'hi'}, '"output" must be a string'),
    ({'input_ids': [1, 2], 'loss_mask': [0, 1]}, 'no text to score'),
    ('{"input": "hi", ', 'not valid JSON'),
])
def test_a_bad_record_names_file_and_line(tmp_path, record, message):
  path = write(tmp_path / 'bad.jsonl', PROMPT, record)
  with pytest.raises(DataError, match=message) as e:
    sft_eval.read_examples(path)
  assert f'{path} line 2' in str(e.value)


def test_missing_or_empty_data_is_named_before_any_generation(tmp_path, model_dir, capsys):  # noqa: F811
  from checkpoint import store  # pylint: disable=import-outside-toplevel
  missing = str(tmp_path / 'nope.jsonl')
  with pytest.raises(DataError, match=f'{missing}: no such file'):
    sft_eval.run([model_dir[0]], missing)
  empty = write(tmp_path / 'empty.jsonl', '')
  with pytest.raises(DataError, match=f'{empty}: no records'):
    sft_eval.run([model_dir[0]], empty)
  data = write(tmp_path / 'd.jsonl', PROMPT)
  with pytest.raises(store.CheckpointError, match='neither an HF model directory'):
    sft_eval.run([model_dir[0], str(tmp_path)], data)
  assert capsys.readouterr().out == ''


def test_the_command_line_says_a_bad_input_in_one_line(tmp_path, model_dir):  # noqa: F811
  missing = str(tmp_path / 'nope.jsonl')
  done = procs.run([sys.executable, '-m', 'tools.sft_eval', f'--model={model_dir[0]}', f'--data={missing}'],
                   timeout=120)
  assert done.returncode != 0 and done.stdout == ''
  assert done.stderr.startswith(f'error: {missing}: no such file') and done.stderr.count('\n') == 1, done.stderr


# ---- end to end

def test_end_to_end_replies_are_generate_tools_and_json_has_one_entry_per_record(tmp_path, model_dir, capsys):  # noqa: F811
  from tools import generate  # pylint: disable=import-outside-toplevel
  path = model_dir[0]
  data = write(tmp_path / 'val.jsonl', CHAT, PROMPT, CHAT)
  out = str(tmp_path / 'results' / 'eval.json')
  sft_eval.run([path, path], data, limit=2, max_new_tokens=6, out=out)
  with open(out, encoding='utf-8') as f:
    results = json.load(f)
  expected = [generate.reply(path, messages=CHAT['messages'][:4], max_new_tokens=6),
              generate.reply(path, prompt=PROMPT['input'], max_new_tokens=6)]
  assert any(expected) and len(results['models']) == 2
  for model in results['models']:
    assert [e['reply'] for e in model['examples']] == expected
    assert [e['reference'] for e in model['examples']] == ['The sea and the sky.', PROMPT['output']]
    assert model['examples'][0]['prompt'] == CHAT['messages'][:4] and model['examples'][1]['prompt'] == PROMPT['input']
    scores = sft_eval.score(expected, ['The sea and the sky.', PROMPT['output']])
    assert model['metrics'] == {k: pytest.approx(scores[k]) for k in ('count', 'exact_match', 'rougeL', 'bleu')}
    assert [e['rougeL'] for e in model['examples']] == pytest.approx(scores['rougeL_each'])
  table = capsys.readouterr().out.splitlines()
  assert table[0] == f'| metric | {path} | {path} |' and table[-1] == '| records | 2 | 2 |'
