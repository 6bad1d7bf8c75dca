"""Megatron's memory-mapped indexed dataset (`<prefix>.bin` + `<prefix>.idx`), read and written.

Byte-compatible with megatron-core `megatron/core/datasets/indexed_dataset.py` (and so with
Megatron-LM, NeMo and NxD Training `preprocess_data.py` outputs). All integers little-endian.

  .idx  offset  size        field
        0       9           magic b'MMIDIDX\\x00\\x00'
        9       8   <Q      version, always 1
        17      1   <B      dtype code of the tokens in .bin (see DTYPE_CODES)
        18      8   <Q      sequence count N
        26      8   <Q      document-index length M (= documents + 1: it starts with 0)
        34      4N  int32   sizes: tokens per sequence
        34+4N   8N  int64   pointers: byte offset of each sequence in .bin
        34+12N  8M  int64   doc_idx: sequence index where each document starts; doc_idx[-1] = N
       (34+12N+8M  N int8   modes, only in multimodal files; ignored here)
  .bin  the sequences' tokens back to back, in the dtype above, no header.

A "sequence" is what one `add_item` wrote; `preprocess_data.py` without --split-sentences
writes one per document, and megatron-core's GPTDataset samples over sequences. We do too.
Tokens are stored as uint16 when the vocabulary has fewer than 65500 entries, else int32.
"""
import array
import os
import struct

import numpy as np

from data.errors import DataError

MAGIC = b'MMIDIDX\x00\x00'
VERSION = 1
HEADER_BYTES = 34
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
# Records per vectorised check: bounds the temporaries when opening 100M+-sequence indexes.
CHECK_CHUNK = 1 << 22


def dtype_for_vocab(vocab_size: int):
  """megatron-core DType.optimal_dtype: the narrowest token dtype that holds the vocabulary."""
  return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def paths(prefix: str):
  return prefix + '.bin', prefix + '.idx'


def _first_true(n: int, is_bad):
  """The smallest i < n where is_bad(lo, hi)[i - lo] holds, or None; CHECK_CHUNK at a time."""
  for lo in range(0, n, CHECK_CHUNK):
    hits = np.flatnonzero(is_bad(lo, min(lo + CHECK_CHUNK, n)))
    if hits.size:
      return lo + int(hits[0])
  return None


def _rebuild(prefix):
  return (f'rebuild {prefix}.bin/.idx together with tools/preprocess.py '
          "(or Megatron's preprocess_data.py)")


def _entry_fault(doc_idx, j, n) -> str:
  value = int(doc_idx[j])
  if not 0 <= value <= n:
    return f'is {value}, outside [0, {n}] (0 to the sequence count)'
  return f'is {value}, below entry {j - 1} ({int(doc_idx[j - 1])}): entries must not decrease'


def _sequence_fault(pointer, size, dtype, bin_path, bin_bytes) -> str:
  if size < 0:
    return f'size {size} is negative'
  if pointer < 0:
    return f'pointer {pointer} is negative'
  if pointer % dtype.itemsize:
    return f'pointer {pointer} is not a multiple of the {dtype.name} size {dtype.itemsize}'
  return (f'its bytes [{pointer}, {pointer + size * dtype.itemsize}) run past the end of '
          f'{bin_path} ({bin_bytes} bytes)')


def exists(prefix: str) -> bool:
  return all(os.path.isfile(p) for p in paths(prefix))


class IndexedDataset:
  """Read-only view of `<prefix>.{bin,idx}`, both memory-mapped.

  Opening checks every index record (vectorised, so a 1M-document index takes milliseconds):
  a corrupt body then fails at once, naming its first bad record, instead of later as huge
  sample indices or an IndexError. The tokens themselves are not read.
  """

  def __init__(self, prefix: str):
    self.prefix = prefix
    bin_path, idx_path = paths(prefix)
    missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
    if missing:
      raise FileNotFoundError(f'indexed dataset {prefix!r}: missing {", ".join(missing)}')
    self._read_index(idx_path)
    self._map_tokens(bin_path)

  def _read_index(self, idx_path):
    file_bytes = os.path.getsize(idx_path)
    with open(idx_path, 'rb') as f:
      header = f.read(HEADER_BYTES)
    if header[:9] == MAGIC and len(header) < HEADER_BYTES:
      raise DataError(f'{idx_path}: {len(header)} bytes, shorter than its {HEADER_BYTES}-byte header: the file is '
                      f'cut short; {_rebuild(self.prefix)}')
    if header[:9] != MAGIC:
      raise DataError(f'{idx_path}: not a Megatron MMIDIDX index (magic {header[:9]!r}, '
                      f'expected {MAGIC!r}); pass the prefix of a preprocess.py output')
    version, = struct.unpack('<Q', header[9:17])
    if version != VERSION:
      raise DataError(f'{idx_path}: index version {version}, only version {VERSION} is '
                      f'supported; {_rebuild(self.prefix)}')
    code, = struct.unpack('<B', header[17:18])
    if code not in DTYPE_CODES:
      raise DataError(f'{idx_path}: unknown token dtype code {code} (known: '
                      f'{sorted(DTYPE_CODES)}); {_rebuild(self.prefix)}')
    self.dtype = np.dtype(DTYPE_CODES[code])
    n, m = struct.unpack('<QQ', header[18:34])
    body = HEADER_BYTES + 12 * n + 8 * m
    if file_bytes not in (body, body + n):   # + n: the optional int8 modes of multimodal files
      raise DataError(f'{idx_path}: {file_bytes} bytes, but the header promises {n} sequences '
                      f'and {m} document-index entries ({body} bytes); the file is truncated '
                      f'or not an index; {_rebuild(self.prefix)}')
    mm = np.memmap(idx_path, mode='r', dtype=np.uint8)
    self.sizes = np.frombuffer(mm, np.int32, n, HEADER_BYTES)
    self.pointers = np.frombuffer(mm, np.int64, n, HEADER_BYTES + 4 * n)
    self.doc_idx = np.frombuffer(mm, np.int64, m, HEADER_BYTES + 12 * n)
    self._check_doc_idx(idx_path)

  def _check_doc_idx(self, idx_path):
    """Entries rise from 0 to N: each within [0, N], none below the one before it."""
    doc_idx, n = self.doc_idx, len(self.sizes)

    def bad(lo, hi):
      before = doc_idx[lo - 1:hi - 1] if lo else np.concatenate(([0], doc_idx[:hi - 1]))
      entries = doc_idx[lo:hi]
      return (entries < before) | (entries < 0) | (entries > n)

    j = _first_true(len(doc_idx), bad)
    if j is not None:
      raise DataError(f'{idx_path}: document index entry {j} of {len(doc_idx)} '
                      f'{_entry_fault(doc_idx, j, n)}; {_rebuild(self.prefix)}')
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != n:
      raise DataError(f'{idx_path}: document index must run from 0 to the sequence count {n}, '
                      f'found {doc_idx[:1].tolist()}..{doc_idx[-1:].tolist()}; '
                      + _rebuild(self.prefix))

  def _map_tokens(self, bin_path):
    n = len(self.sizes)
    actual = os.path.getsize(bin_path)
    self._check_sequences(bin_path, actual)
    expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
    if actual != expected:
      raise DataError(f'{bin_path}: {actual} bytes, but {paths(self.prefix)[1]} describes '
                      f'{expected} bytes of {self.dtype.name} tokens: .bin and .idx disagree; '
                      + _rebuild(self.prefix))
    # np.memmap cannot map an empty file.
    self.tokens = (np.memmap(bin_path, mode='r', dtype=self.dtype) if actual
                   else np.empty(0, self.dtype))

  def _check_sequences(self, bin_path, bin_bytes):
    """Each sequence's bytes [pointer, pointer + size * itemsize) lie inside the .bin."""
    sizes, pointers, item = self.sizes, self.pointers, self.dtype.itemsize

    def bad(lo, hi):
      s, p = sizes[lo:hi], pointers[lo:hi]
      # Against bin_bytes - p: p + length can overflow int64 when p is garbage.
      past_end = s.astype(np.int64) * item > bin_bytes - p
      return (s < 0) | (p < 0) | (p % item != 0) | past_end

    i = _first_true(len(sizes), bad)
    if i is not None:
      fault = _sequence_fault(int(pointers[i]), int(sizes[i]), self.dtype, bin_path, bin_bytes)
      raise DataError(f'{paths(self.prefix)[1]}: sequence {i} of {len(sizes)}: {fault}; '
                      + _rebuild(self.prefix))

  def token_start(self, i):
    """Offset in tokens (pointers are in bytes) of sequence(s) i, for indexing `tokens`."""
    return self.pointers[i] // self.dtype.itemsize

  def __len__(self):
    return len(self.sizes)

  @property
  def num_documents(self):
    return len(self.doc_idx) - 1

  def __getitem__(self, i) -> np.ndarray:
    return self.get(i)

  def get(self, i, offset=0, length=None) -> np.ndarray:
    """Tokens [offset, offset + length) of sequence i (megatron-core IndexedDataset.get)."""
    if length is None:
      length = int(self.sizes[i]) - offset
    start = int(self.token_start(i)) + offset
    return np.asarray(self.tokens[start:start + length])


class IndexedDatasetWriter:
  """Streams sequences into `<prefix>.bin`; `finalize()` writes `<prefix>.idx`.

  Mirrors megatron-core IndexedDatasetBuilder: `add_item` appends one sequence,
  `end_document` closes a document; `add_document` does both for a one-sequence document.
  """

  def __init__(self, prefix: str, dtype=np.int32):
    self.prefix = prefix
    self.dtype = np.dtype(dtype)
    if self.dtype not in CODE_OF_DTYPE:
      raise DataError(f'{prefix}: dtype {self.dtype} has no Megatron dtype code; use one of '
                      f'{sorted(t.name for t in CODE_OF_DTYPE)}')
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    self._bin = open(paths(prefix)[0], 'wb')
    self._sizes = array.array('q')    # compact for corpora with 100M+ sequences
    self._doc_idx = array.array('q', [0])

  def add_item(self, tokens):
    tokens = np.asarray(tokens)
    info = np.iinfo(self.dtype) if self.dtype.kind in 'iu' else None
    if info is not None and tokens.size and (tokens.min() < info.min or tokens.max() > info.max):
      raise DataError(f'{self.prefix}: token ids outside {self.dtype.name} range '
                      f'[{info.min}, {info.max}]; write with a wider dtype (int32)')
    self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order='C'))
    self._sizes.append(tokens.size)

  def end_document(self):
    self._doc_idx.append(len(self._sizes))

  def add_document(self, tokens):
    self.add_item(tokens)
    self.end_document()

  def finalize(self):
    self._bin.close()
    sizes = np.frombuffer(self._sizes, np.int64) if len(self._sizes) else np.zeros(0, np.int64)
    if sizes.size and sizes.max() > np.iinfo(np.int32).max:
      raise DataError(f'{self.prefix}: a sequence longer than 2^31 tokens cannot be indexed; '
                      'split it into several items')
    pointers = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
    doc_idx = np.frombuffer(self._doc_idx, np.int64)
    with open(paths(self.prefix)[1], 'wb') as f:
      f.write(MAGIC)
      f.write(struct.pack('<Q', VERSION))
      f.write(struct.pack('<B', CODE_OF_DTYPE[self.dtype]))
      f.write(struct.pack('<Q', len(sizes)))
      f.write(struct.pack('<Q', len(doc_idx)))
      f.write(sizes.astype(np.int32).tobytes(order='C'))
      f.write(pointers.tobytes(order='C'))
      f.write(doc_idx.tobytes(order='C'))

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *_):
    if exc_type is None:
      self.finalize()
      return
    # A half-written .bin beside an older .idx would look like a dataset: leave neither.
    self._bin.close()
    for path in paths(self.prefix):
      if os.path.exists(path):
        os.remove(path)


def write(prefix: str, documents, dtype=np.int32):
  """Writes each token list of `documents` as one single-sequence document."""
  with IndexedDatasetWriter(prefix, dtype) as w:
    for doc in documents:
      w.add_document(doc)
