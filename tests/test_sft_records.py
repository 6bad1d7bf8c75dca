"""SFT records (data/sft_records.py, read through data/sft.py): every format (JSON lines, a JSON
list, save_to_disk, its .arrow file, a directory) reads the same records, dev_choose_samples takes
the first ones, and a bad record is named by file and line, a missing path or empty directory clearly."""
import json
import os
import shutil

import pytest

from data import sft
from data.errors import DataError
from tests.test_chat import SMOL, SPECIALS
from tests.test_sft import MIXED, PROMPTS, examples_of, tok, tok_dir, write_jsonl  # pylint: disable=unused-import


@pytest.mark.parametrize('line, message', [
    ('{"input": "a"}', r'line 3: "output" must be a string, got missing'),
    ('{"input": "a", "output": 7}', r'line 3: "output" must be a string, got int'),
    ('{"prompt": "a", "completion": "b"}', r'line 3: a record needs "input" and "output"'),
    ('{"input": "a", "output": "b"', r'line 3: not valid JSON .*fix or remove the line'),
    ('[1, 2]', r'line 3: expected a JSON object, got list'),
    ('{"messages": "hi"}', r'line 3: messages is str'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}',
     r'line 3: messages\[1\]\["content"\] is missing'),
    ('{"messages": [{"role": "user", "content": "a"}]}', r'line 3: no assistant message'),
    ('{"input_ids": [1, 2], "labels": [-100]}', r'line 3: labels must be input_ids'),
    ('{"input_ids": [1, 2], "loss_mask": [0, 2]}', r'line 3: loss_mask must be 0/1'),
    ('{"input_ids": ["a"], "loss_mask": [1]}', r'line 3: "input_ids" must be a list of integers'),
    ('{"input_ids": [1, 2]}', r'line 3: pre-tokenized records need'),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
  path = write_jsonl(tmp_path / 'bad.jsonl', [PROMPTS[0], '', line])   # line 2 is blank
  with pytest.raises(DataError, match=f'bad.jsonl {message}'):
    sft.read_records(path)


def test_bytes_that_are_not_text_and_a_damaged_saved_dataset_name_the_file(tmp_path):
  (tmp_path / 'bin.jsonl').write_bytes(json.dumps(PROMPTS[0]).encode() + b'\n\xff\xfe garbage\n')
  with pytest.raises(DataError, match=r'bin.jsonl line 2: not UTF-8 text \(column 1\)'):
    sft.read_records(str(tmp_path / 'bin.jsonl'))
  (tmp_path / 'bin.json').write_bytes(b'[\xff]')
  with pytest.raises(DataError, match=r'bin.json: not UTF-8 text'):
    sft.read_records(str(tmp_path / 'bin.json'))
  os.makedirs(tmp_path / 'saved')
  (tmp_path / 'saved' / 'state.json').write_text('{ cut')           # a save_to_disk directory, damaged
  with pytest.raises(DataError, match=r'saved: not a readable save_to_disk directory'):
    sft.read_records(str(tmp_path / 'saved'))


def test_broken_json_list_names_its_line(tmp_path):
  (tmp_path / 'list.json').write_text('[\n {"input": "a", "output": "b"},\n {"input": }\n]')
  with pytest.raises(DataError, match='list.json line 3: not valid JSON'):
    sft.read_records(str(tmp_path / 'list.json'))
  (tmp_path / 'types.json').write_text(json.dumps([PROMPTS[0], {'input': 'a', 'output': None}]))
  with pytest.raises(DataError, match='types.json record 1: "output" must be a string'):
    sft.read_records(str(tmp_path / 'types.json'))


def test_missing_paths_and_empty_directories_are_clear(tmp_path):
  with pytest.raises(DataError, match='no such file'):
    sft.read_records(str(tmp_path / 'nope.jsonl'))
  with pytest.raises(DataError, match='no .jsonl, .json or .arrow files'):
    sft.read_records(str(tmp_path))
  with pytest.raises(DataError, match='data.train_dir'):
    sft.read_records(None)


def saved_formats(tmp_path, rows):
  """The same rows as JSON lines, a JSON list, save_to_disk, its .arrow file and a directory."""
  import datasets
  keys = sorted({k for r in rows for k in r})
  columns = {k: [r.get(k) for r in rows] for k in keys}    # columnar: absent keys are null
  saved = str(tmp_path / 'saved')
  datasets.Dataset.from_dict(columns).save_to_disk(saved)
  arrow, = [f for f in os.listdir(saved) if f.endswith('.arrow')]
  shutil.copy(os.path.join(saved, arrow), tmp_path / 'rows.arrow')
  (tmp_path / 'rows.json').write_text(json.dumps(rows, indent=1))
  parts = tmp_path / 'parts'
  parts.mkdir()
  write_jsonl(parts / 'a.jsonl', rows[:2])
  (parts / 'b.json').write_text(json.dumps(rows[2:]))
  return {'jsonl': write_jsonl(tmp_path / 'rows.jsonl', rows), 'json': str(tmp_path / 'rows.json'),
          'save_to_disk': saved, 'arrow': str(tmp_path / 'rows.arrow'), 'directory': str(parts)}


def test_every_format_reads_the_same_records(tmp_path, tok):
  paths = saved_formats(tmp_path, MIXED)
  for name, path in paths.items():
    records = sft.read_records(path)
    assert [r.fields for r in records] == MIXED, name
    got = sft.tokenize(records, tok, SMOL, SPECIALS)
    for (ids, target), (want_ids, want_target) in zip(got, examples_of(MIXED, tok)):
      assert ids.tolist() == want_ids.tolist() and target.tolist() == want_target.tolist()
  assert sft.read_records(paths['jsonl'])[3].where == f'{paths["jsonl"]} line 4'
  assert sft.read_records(paths['save_to_disk'])[3].where.endswith('saved record 3')


def test_pretokenized_save_to_disk(tmp_path):
  import datasets
  datasets.Dataset.from_dict({'input_ids': [[1, 2, 3], [4, 5]],
                              'labels': [[-100, 2, 3], [-100, 5]]}).save_to_disk(tmp_path / 'd')
  examples = sft.tokenize(sft.read_records(str(tmp_path / 'd')), None)
  assert [t.tolist() for _, t in examples] == [[0, 1, 1], [0, 1]]
  with pytest.raises(DataError, match='text records need a tokenizer'):
    sft.tokenize([sft.Record('r', PROMPTS[0])], None)


def test_dev_choose_samples_takes_the_first_records(tmp_path):
  rows = [{'input': f'q{i}', 'output': f'a{i}'} for i in range(7)]
  for path in saved_formats(tmp_path, rows).values():
    for limit in (0, 1, 3, 7, 100):
      assert [r.fields for r in sft.read_records(path, limit)] == rows[:limit], path

