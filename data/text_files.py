"""The text source's files (data/text.py): each a reader of its documents' texts from any one of
them on, so a window far into the stream reads only the documents it needs.

  .jsonl    one JSON object per line, the text under the key; blank lines are skipped. A
            document's place is the byte offset of its line.
  .parquet  the key's column (strings), read with pyarrow one record batch at a time from the
            row group holding the first document wanted. A document's place is its row.
Errors name the file and the line (counted only when an error needs it) or row.
"""
import json
import os

import numpy as np

from data.errors import DataError

EXTENSIONS = ('.jsonl', '.parquet')
BATCH_ROWS = 1024      # parquet rows per record batch: the texts held at once


def reader(path, key):
  return (Parquet if path.endswith('.parquet') else JsonLines)(path, key)


def _no_documents(path, what):
  return DataError(f'{path}: no documents ({what}); remove it from the data.text files')


class JsonLines:

  def __init__(self, path, key):
    self.path, self.key = path, key
    if os.path.getsize(path) == 0:
      raise _no_documents(path, 'an empty file')

  def where(self, start) -> str:
    """'file line N' of the line starting at byte `start`."""
    with open(self.path, 'rb') as f:
      before, left = 0, start
      while left > 0:
        block = f.read(min(left, 1 << 20))
        if not block:
          break
        before, left = before + block.count(b'\n'), left - len(block)
    return f'{self.path} line {before + 1}'

  def read(self, start=0):
    """(byte offset, text) of each document whose line starts at `start` or later."""
    with open(self.path, 'rb') as f:
      f.seek(start)
      for line in iter(f.readline, b''):
        here, start = start, start + len(line)
        if line.strip():
          yield here, self._text(here, line)

  def _text(self, start, line):
    try:
      value = json.loads(line)
    except ValueError as e:       # not JSON, or not UTF-8
      raise DataError(f'{self.where(start)}: not valid JSON ({getattr(e, "msg", e)}); fix or remove the line '
                      '(one JSON object per line)') from None
    if not isinstance(value, dict) or self.key not in value:
      raise DataError(f'{self.where(start)}: no {self.key!r} field; set data.text.key to the field holding the text')
    if not isinstance(value[self.key], str):
      raise DataError(f'{self.where(start)}: field {self.key!r} holds {type(value[self.key]).__name__}, not text; '
                      'set data.text.key to the field holding the text, or fix the line')
    return value[self.key]


class Parquet:

  def __init__(self, path, key):
    self.path, self.key = path, key
    try:
      import pyarrow as pa
      import pyarrow.parquet as pq
    except ImportError:
      raise DataError(f'{path}: reading .parquet needs pyarrow; pip install pyarrow') from None
    try:
      meta = pq.ParquetFile(path).metadata
      schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
      raise DataError(f'{path}: not a readable parquet file ({str(e).splitlines()[0][:160]}); copy it again') from None
    if key not in schema.names:
      raise DataError(f'{path}: no column {key!r} (its columns: {", ".join(schema.names)}); set data.text.key to '
                      'the column holding the text')
    kind = schema.field(key).type
    if pa.types.is_dictionary(kind):
      kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, 'is_string_view',
                                                                                  lambda _: False)(kind)):
      raise DataError(f'{path}: column {key!r} holds {schema.field(key).type}, not text; set data.text.key to the '
                      'column holding the text')
    if meta.num_rows == 0:
      raise _no_documents(path, 'no rows')
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    self.group_starts = np.cumsum([0] + sizes[:-1])

  def where(self, row) -> str:
    return f'{self.path} row {row}'

  def read(self, start=0):
    """(row, text) of each row from `start` on."""
    import pyarrow.parquet as pq
    group = int(np.searchsorted(self.group_starts, start, side='right')) - 1
    row = int(self.group_starts[group])
    batches = pq.ParquetFile(self.path).iter_batches(
        batch_size=BATCH_ROWS, row_groups=list(range(group, len(self.group_starts))), columns=[self.key])
    for batch in batches:
      skip = min(max(start - row, 0), len(batch))
      for i, text in enumerate(batch.column(0).slice(skip).to_pylist(), row + skip):
        if not isinstance(text, str):
          raise DataError(f'{self.where(i)}: {self.key!r} is {type(text).__name__}, not text; fill or drop the row')
        yield i, text
      row += len(batch)
