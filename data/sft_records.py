"""SFT records, read and checked: a `datasets` save_to_disk directory, `.jsonl` / `.json`
(JSON lines or a JSON list) / `.arrow` files, or a directory of such files. Each record is one of
  {"input": str, "output": str}        prompt and response
  {"messages": [{"role", "content"}]}  a conversation for the chat template
  {"input_ids", "loss_mask" | "labels"} pre-tokenized
Other keys are ignored; null counts as absent. A bad record is a DataError naming the file and
line (or record index). data/sft.py turns records into examples and rows.
"""
import itertools
import os
import typing

import numpy as np

from data.errors import DataError

FILE_TYPES = ('.jsonl', '.json', '.arrow')
RECORD_FORMS = ('a record needs "input" and "output" (strings), "messages" (a list of '
                '{"role", "content"} objects), or "input_ids" with "loss_mask" or "labels" '
                '(pre-tokenized)')


class Record(typing.NamedTuple):
  where: str     # 'file line 7' or 'dir record 3': what an error names
  fields: dict


def read_records(path, limit=None) -> list:
  """The first `limit` (all when None) records under `path`, each checked (`record_kind`)."""
  records = read_files(path, limit)
  for record in records:
    record_kind(record)
  return records


def read_files(path, limit=None, what='SFT', forms=RECORD_FORMS) -> list:
  """The first `limit` records under `path` as Records of JSON objects, their fields not yet
  checked (data/preference.py reads its pairs with this too); `what` and `forms` go in errors."""
  if not path:
    raise DataError(f'{what} data: no path set; set data.train_dir (and data.val_dir) to a '
                    'save_to_disk directory, a .jsonl/.json/.arrow file or a directory of them')
  if not os.path.exists(path):
    raise DataError(f'{path}: no such file or directory; point data.train_dir / data.val_dir '
                    f'at the {what} data')
  if _is_saved_dataset(path):
    values = _read_saved(path, limit)
  elif os.path.isdir(path):
    files = [os.path.join(path, name) for name in _data_files(path, what)]
    values = itertools.chain.from_iterable(_read_file(f, limit, what) for f in files)
  else:
    values = _read_file(path, limit, what)
  # Lazily, up to the limit: lines past it are not read (nor their errors raised).
  return [_record(where, value, forms) for where, value in itertools.islice(values, limit)]


def _is_saved_dataset(path):
  return os.path.isdir(path) and any(
      os.path.isfile(os.path.join(path, f)) for f in ('state.json', 'dataset_dict.json'))


def _data_files(directory, what):
  names = sorted(n for n in os.listdir(directory) if n.endswith(FILE_TYPES))
  if not names:
    raise DataError(f'{directory}: no .jsonl, .json or .arrow files and not a save_to_disk '
                    f'directory; put the {what} data there or point the path at the data itself')
  return names


def _read_file(path, limit, what):
  """(where, value) of each record in the file: a list, or an iterator for JSON lines."""
  if path.endswith('.jsonl'):
    return read_json_lines(path)
  if path.endswith('.json'):
    return _read_json(path, limit)
  if path.endswith('.arrow'):
    return _read_arrow(path, limit)
  raise DataError(f'{path}: unknown file type; {what} data is .jsonl, .json or .arrow (or a '
                  'save_to_disk directory)')


def read_json_lines(path):
  """(where, value) of each non-blank line of the JSON lines file `path`, lazily; `where` is
  'file line 7', for errors (tools/preprocess.py reads its documents with this too)."""
  # Read here, not by `datasets`: it merges all lines into one schema (a missing key becomes
  # null, types get cast) and loses line numbers, which errors must name.
  import json
  with open(path, 'rb') as f:
    for line_number, line in _lines(path, f):
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f'{path} line {line_number}: not valid JSON ({e.msg}, column {e.colno});'
                        ' fix or remove the line (one JSON object per line)') from None
      yield f'{path} line {line_number}', value


def _lines(path, f):
  """Numbered text lines of the binary file `f`; a line that is not UTF-8 is an error naming it."""
  for line_number, raw in enumerate(f, 1):
    try:
      yield line_number, raw.decode('utf-8')
    except UnicodeDecodeError as e:
      raise DataError(f'{path} line {line_number}: not UTF-8 text (column {e.start + 1}); the file is damaged or '
                      'not JSON lines') from None


def _read_json(path, limit):
  """A JSON list of records, or JSON lines in a .json file (both as `datasets` reads them)."""
  import json
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not UTF-8 text (byte {e.start}); the file is damaged or not JSON') from None
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    if text.lstrip().startswith('['):
      raise DataError(f'{path} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno}); '
                      'fix the JSON list of records') from None
    value = None        # several values: JSON lines
  if not isinstance(value, list):
    return read_json_lines(path)
  value = value if limit is None else value[:limit]
  return [(f'{path} record {i}', v) for i, v in enumerate(value)]


def _read_arrow(path, limit):
  import datasets
  try:
    table = datasets.Dataset.from_file(path)
  except Exception as e:  # pyarrow raises several types for a file that is not Arrow
    raise DataError(f'{path}: not a readable Arrow file ({e}); write it with datasets '
                    '(Dataset.save_to_disk) or use JSON lines') from None
  return _rows(path, table, limit)


def _read_saved(path, limit):
  import datasets
  try:
    loaded = datasets.load_from_disk(path)
  except Exception as e:  # pylint: disable=broad-except   (datasets and pyarrow raise several types)
    raise DataError(f'{path}: not a readable save_to_disk directory ({str(e).splitlines()[0][:160]}); save it again '
                    'with Dataset.save_to_disk, or use JSON lines') from None
  if isinstance(loaded, datasets.DatasetDict):
    raise DataError(f'{path}: a DatasetDict with splits {sorted(loaded)}; point data.train_dir '
                    f'/ data.val_dir at one split\'s directory, e.g. {path}/train')
  return _rows(path, loaded, limit)


def _rows(path, dataset, limit):
  if limit is not None:
    dataset = dataset.select(range(min(limit, len(dataset))))
  return [(f'{path} record {i}', row) for i, row in enumerate(dataset.to_list())]


def _record(where, value, forms=RECORD_FORMS):
  if not isinstance(value, dict):
    raise DataError(f'{where}: expected a JSON object, got {_type(value)}; {forms}')
  # Columnar formats give every row every column: null means the row does not have it.
  return Record(where, {k: v for k, v in value.items() if v is not None})


def record_kind(record) -> str:
  """'prompt', 'chat' or 'tokens', after checking the record's types (DataError if wrong)."""
  where, f = record.where, record.fields
  if 'input_ids' in f:
    _check_tokens(where, f)
    return 'tokens'
  if 'messages' in f:
    _check_messages(where, f['messages'])
    return 'chat'
  if 'input' in f or 'output' in f:
    for key in ('input', 'output'):
      if not isinstance(f.get(key), str):
        raise DataError(f'{where}: "{key}" must be a string, got {_type(f.get(key))}; '
                        'input/output records need both as strings')
    return 'prompt'
  raise DataError(f'{where}: {RECORD_FORMS}; this one has keys {sorted(f)}')


def _check_messages(where, messages):
  fix = 'messages is a list of {"role": str, "content": str} with at least one assistant turn'
  if not isinstance(messages, list) or not messages:
    raise DataError(f'{where}: messages is {_type(messages)}; {fix}')
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get('role'), str):
      raise DataError(f'{where}: messages[{i}] has no string "role"; {fix}')
    content = m.get('content')
    # Tool-calling assistant turns may carry tool_calls instead of content.
    if not isinstance(content, str) and not (content is None and m.get('tool_calls')):
      raise DataError(f'{where}: messages[{i}]["content"] is {_type(content)}; {fix}')
  if not any(m['role'] == 'assistant' for m in messages):
    raise DataError(f'{where}: no assistant message, so nothing to train on; {fix}')


def _check_tokens(where, f):
  ids = _int_array(where, 'input_ids', f['input_ids'])
  if ids.size == 0 or ids.min() < 0:
    raise DataError(f'{where}: input_ids must be a non-empty list of token ids >= 0')
  if 'loss_mask' in f:
    mask = _int_array(where, 'loss_mask', f['loss_mask'])
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
      raise DataError(f'{where}: loss_mask must be 0/1, one per input_ids token '
                      f'({mask.size} for {ids.size})')
  elif 'labels' in f:
    labels = _int_array(where, 'labels', f['labels'])
    if labels.shape != ids.shape or not ((labels == -100) | (labels == ids)).all():
      raise DataError(f'{where}: labels must be input_ids with -100 where not trained, one per '
                      f'token ({labels.size} for {ids.size}); shift-free, as Hugging Face models')
  else:
    raise DataError(f'{where}: pre-tokenized records need "loss_mask" or "labels" beside '
                    '"input_ids"')


def _int_array(where, key, value):
  array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
  # Whole floats pass (float loss masks are common); anything else is not a token list.
  whole = array is not None and (array.dtype.kind in 'iub' or (
      array.dtype.kind == 'f' and np.array_equal(array, np.round(array))))
  if not whole or array.ndim != 1:
    raise DataError(f'{where}: "{key}" must be a list of integers, got {_token_list_type(value)}')
  return array.astype(np.int64)


def _type(value):
  return 'missing' if value is None else type(value).__name__


def _token_list_type(value):
  """What a value given as a token list is, for an error: a list says what its first
  non-integer item is."""
  if isinstance(value, (list, tuple)):
    bad = next((v for v in value if not isinstance(v, (int, float)) or isinstance(v, bool)), None)
    return f'a list holding {type(bad).__name__} {bad!r:.40}' if bad is not None else 'a list with fractional numbers'
  return _type(value)


