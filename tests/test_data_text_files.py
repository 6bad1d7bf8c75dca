"""data/text_files.py: the text source's readers of .jsonl and .parquet documents, from any
document on, and their errors naming the file and the line or row."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import text_files
from data.errors import DataError


def jsonl(tmp_path, body, name='docs.jsonl'):
  (tmp_path / name).write_bytes(body.encode() if isinstance(body, str) else body)
  return str(tmp_path / name)


def parquet(tmp_path, columns, name='docs.parquet', **kwargs):
  pq.write_table(pa.table(columns), tmp_path / name, **kwargs)
  return str(tmp_path / name)


def test_jsonl_documents_from_any_line_on(tmp_path):
  path = jsonl(tmp_path, '{"text": "a"}\n\n{"text": "bb", "id": 2}\n{"text": ""}\n')
  docs = list(text_files.reader(path, 'text').read())
  assert docs == [(0, 'a'), (15, 'bb'), (39, '')]           # blank lines are no document
  assert list(text_files.reader(path, 'text').read(15)) == docs[1:]
  assert text_files.reader(path, 'text').where(39) == f'{path} line 4'


def test_parquet_rows_from_any_row_on_in_record_batches(tmp_path, monkeypatch):
  monkeypatch.setattr(text_files, 'BATCH_ROWS', 2)
  texts = [f'doc {i}' for i in range(11)]
  path = parquet(tmp_path, {'n': list(range(11)), 'body': texts}, row_group_size=4)
  docs = text_files.reader(path, 'body')
  assert list(docs.read()) == list(enumerate(texts))
  for start in (3, 4, 5, 10):
    assert list(docs.read(start)) == list(enumerate(texts))[start:]
  assert docs.where(7) == f'{path} row 7'


@pytest.mark.parametrize('body,message', [
    ('{"text": "a"}\n\n{"text": "b",}\n', r'docs.jsonl line 3: not valid JSON \(.*\); fix or remove the line'),
    (b'{"text": "a"}\n{"text": "\xff"}\n', r'docs.jsonl line 2: not valid JSON'),
    ('{"text": "a"}\n{"body": "b"}\n', r"docs.jsonl line 2: no 'text' field; set data.text.key to the field"),
    ('["text"]\n', r"docs.jsonl line 1: no 'text' field"),
    ('{"text": "a"}\n{"text": 7}\n', r"docs.jsonl line 2: field 'text' holds int, not text"),
    ('{"text": null}\n', r"docs.jsonl line 1: field 'text' holds NoneType, not text"),
    ('', r'docs.jsonl: no documents \(an empty file\); remove it from the data.text files'),
])
def test_bad_jsonl_names_the_file_and_line(tmp_path, body, message):
  with pytest.raises(DataError, match=message):
    list(text_files.reader(jsonl(tmp_path, body), 'text').read())


def test_a_bad_line_read_from_the_middle_of_the_file_is_named_by_its_line(tmp_path):
  path = jsonl(tmp_path, '{"text": "a"}\n{"text": "b"}\n\n{"text": 1}\n')
  with pytest.raises(DataError, match='docs.jsonl line 4: '):
    list(text_files.reader(path, 'text').read(14))


@pytest.mark.parametrize('columns,message', [
    ({'body': ['a']}, r"docs.parquet: no column 'text' \(its columns: body\); set data.text.key"),
    ({'text': [1, 2]}, r"docs.parquet: column 'text' holds int64, not text"),
    ({'text': ['a', None]}, r"docs.parquet row 1: 'text' is NoneType, not text"),
    ({'text': pa.array([], pa.string())}, r'docs.parquet: no documents \(no rows\)'),
])
def test_bad_parquet_names_the_file_and_row(tmp_path, columns, message):
  with pytest.raises(DataError, match=message):
    list(text_files.reader(parquet(tmp_path, columns), 'text').read())


def test_a_file_that_is_not_parquet_is_named(tmp_path):
  with pytest.raises(DataError, match='docs.parquet: not a readable parquet file'):
    text_files.reader(jsonl(tmp_path, '{"text": "a"}\n', 'docs.parquet'), 'text')
