"""The .bin/.idx format: byte layout checked field by field, round trips, bad-input errors."""
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from data import gpt_dataset, indexed
from data.errors import DataError

# megatron-core DType: the codes every Megatron-family tool writes.
MEGATRON_CODES = {1: 'uint8', 2: 'int8', 3: 'int16', 4: 'int32', 5: 'int64', 6: 'float64',
                  7: 'float32', 8: 'uint16'}
DOCS = [[5, 6, 7], [8], [], [9, 10, 11, 12]]


def parse_idx(path):
  """An independent reader of the documented layout."""
  raw = Path(path).read_bytes()
  magic, version, code, n, m = raw[:9], *struct.unpack('<QBQQ', raw[9:34])
  sizes = np.frombuffer(raw, np.int32, n, 34)
  pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n)
  doc_idx = np.frombuffer(raw, np.int64, m, 34 + 12 * n)
  return dict(magic=magic, version=version, code=code, n=n, m=m, sizes=sizes,
              pointers=pointers, doc_idx=doc_idx, trailing=len(raw) - (34 + 12 * n + 8 * m))


def test_dtype_codes_and_vocab_rule_match_megatron():
  assert {c: np.dtype(t).name for c, t in indexed.DTYPE_CODES.items()} == MEGATRON_CODES
  assert indexed.dtype_for_vocab(65499) == np.uint16
  assert indexed.dtype_for_vocab(65500) == np.int32
  assert indexed.dtype_for_vocab(128256) == np.int32


@pytest.mark.parametrize('dtype,code', [(np.uint16, 8), (np.int32, 4)])
def test_byte_layout_field_by_field(tmp_path, dtype, code):
  prefix = str(tmp_path / 'corpus')
  indexed.write(prefix, DOCS, dtype)
  f = parse_idx(prefix + '.idx')
  assert f['magic'] == b'MMIDIDX\x00\x00'
  assert f['version'] == 1
  assert f['code'] == code
  assert f['n'] == 4 and f['m'] == 5
  assert f['sizes'].tolist() == [3, 1, 0, 4]
  item = np.dtype(dtype).itemsize
  assert f['pointers'].tolist() == [0, 3 * item, 4 * item, 4 * item]
  assert f['doc_idx'].tolist() == [0, 1, 2, 3, 4]
  assert f['trailing'] == 0
  flat = np.concatenate([np.asarray(d, dtype) for d in DOCS])
  assert Path(prefix + '.bin').read_bytes() == flat.tobytes()


def test_idx_bytes_equal_a_hand_built_megatron_index(tmp_path):
  prefix = str(tmp_path / 'c')
  indexed.write(prefix, [[1, 2], [3, 4, 5]], np.uint16)
  expected = (b'MMIDIDX\x00\x00' + struct.pack('<Q', 1) + struct.pack('<B', 8)
              + struct.pack('<Q', 2) + struct.pack('<Q', 3)
              + struct.pack('<2i', 2, 3) + struct.pack('<2q', 0, 4) + struct.pack('<3q', 0, 1, 2))
  assert Path(prefix + '.idx').read_bytes() == expected
  assert Path(prefix + '.bin').read_bytes() == struct.pack('<5H', 1, 2, 3, 4, 5)


def test_round_trip_is_memory_mapped(tmp_path):
  prefix = str(tmp_path / 'corpus')
  docs = [np.random.default_rng(i).integers(0, 50000, size=i * 7 % 23) for i in range(50)]
  indexed.write(prefix, docs, np.uint16)
  ds = indexed.IndexedDataset(prefix)
  assert isinstance(ds.tokens, np.memmap)
  assert len(ds) == 50 and ds.num_documents == 50 and ds.dtype == np.uint16
  for i, d in enumerate(docs):
    assert ds[i].tolist() == d.tolist()
  assert ds.get(3, offset=2, length=3).tolist() == docs[3][2:5].tolist()


def test_documents_of_several_sequences(tmp_path):
  prefix = str(tmp_path / 'sentences')
  with indexed.IndexedDatasetWriter(prefix, np.int32) as w:
    w.add_item([1, 2])
    w.add_item([3])
    w.end_document()
    w.add_document([4, 5, 6])
  ds = indexed.IndexedDataset(prefix)
  assert ds.doc_idx.tolist() == [0, 2, 3]
  assert [ds[i].tolist() for i in range(3)] == [[1, 2], [3], [4, 5, 6]]


def test_reads_multimodal_files_ignoring_modes(tmp_path):
  prefix = str(tmp_path / 'mm')
  indexed.write(prefix, [[1, 2], [3]], np.int32)
  with open(prefix + '.idx', 'ab') as f:
    f.write(np.zeros(2, np.int8).tobytes())
  assert indexed.IndexedDataset(prefix)[1].tolist() == [3]


def test_writer_rejects_ids_outside_dtype(tmp_path):
  with pytest.raises(DataError, match='outside uint16'):
    indexed.write(str(tmp_path / 'big'), [[70000]], np.uint16)
  assert not (tmp_path / 'big.bin').exists() and not (tmp_path / 'big.idx').exists()


# Bad input: every error names the file at fault.

@pytest.fixture
def good(tmp_path):
  prefix = str(tmp_path / 'good')
  indexed.write(prefix, DOCS, np.uint16)
  return prefix


def test_missing_files(tmp_path, good):
  with pytest.raises(FileNotFoundError, match='nothing.idx'):
    indexed.IndexedDataset(str(tmp_path / 'nothing'))
  (tmp_path / 'good.bin').unlink()
  with pytest.raises(FileNotFoundError, match='good.bin'):
    indexed.IndexedDataset(good)


def patch(path, offset, data):
  raw = bytearray(Path(path).read_bytes())
  raw[offset:offset + len(data)] = data
  Path(path).write_bytes(bytes(raw))


def test_bad_magic(good):
  patch(good + '.idx', 0, b'TNTIDX\x00\x00\x00')
  with pytest.raises(DataError, match=r'good.idx: not a Megatron MMIDIDX'):
    indexed.IndexedDataset(good)


def test_bad_version(good):
  patch(good + '.idx', 9, struct.pack('<Q', 2))
  with pytest.raises(DataError, match=r'good.idx: index version 2'):
    indexed.IndexedDataset(good)


def test_bad_dtype_code(good):
  patch(good + '.idx', 17, struct.pack('<B', 42))
  with pytest.raises(DataError, match=r'good.idx: unknown token dtype code 42'):
    indexed.IndexedDataset(good)


def test_truncated_index(good):
  raw = Path(good + '.idx').read_bytes()
  Path(good + '.idx').write_bytes(raw[:-8])
  with pytest.raises(DataError, match=r'good.idx: .*truncated'):
    indexed.IndexedDataset(good)


def test_bin_and_idx_sizes_disagree(good):
  with open(good + '.bin', 'ab') as f:
    f.write(b'\x00\x00')
  with pytest.raises(DataError, match=r'good.bin: 18 bytes.*16 bytes.*disagree'):
    indexed.IndexedDataset(good)


# A corrupt body (the header is fine): one DataError at open, naming the first bad record.
# good.idx: sizes [3, 1, 0, 4] at 34, pointers [0, 6, 8, 8] at 50, doc_idx [0..4] at 82.

def sizes_at(i):
  return 34 + 4 * i


def pointer_at(i):
  return 34 + 4 * len(DOCS) + 8 * i


def doc_idx_at(j):
  return 34 + 12 * len(DOCS) + 8 * j


@pytest.mark.parametrize('seq,size,message', [
    (2, -5, r'sequence 2 of 4: size -5 is negative'),
    (1, 2**31 - 1, r'sequence 1 of 4: its bytes \[6, 4294967300\) run past the end of '
                   r'\S*good.bin \(16 bytes\)')])
def test_garbage_sizes(good, seq, size, message):
  patch(good + '.idx', sizes_at(seq), struct.pack('<i', size))
  with pytest.raises(DataError, match=r'good.idx: ' + message):
    indexed.IndexedDataset(good)


@pytest.mark.parametrize('seq,pointer,message', [
    (1, 1000, r'sequence 1 of 4: its bytes \[1000, 1002\) run past the end of \S*good.bin'),
    (1, 7, r'sequence 1 of 4: pointer 7 is not a multiple of the uint16 size 2'),
    (3, -8, r'sequence 3 of 4: pointer -8 is negative')])
def test_pointer_outside_the_bin(good, seq, pointer, message):
  patch(good + '.idx', pointer_at(seq), struct.pack('<q', pointer))
  with pytest.raises(DataError, match=r'good.idx: ' + message):
    indexed.IndexedDataset(good)


@pytest.mark.parametrize('entry,value,message', [
    (2, 0, r'document index entry 2 of 5 is 0, below entry 1 \(1\)'),
    (1, 99, r'document index entry 1 of 5 is 99, outside \[0, 4\]'),
    (0, -1, r'document index entry 0 of 5 is -1, outside \[0, 4\]')])
def test_non_monotone_document_index(good, entry, value, message):
  patch(good + '.idx', doc_idx_at(entry), struct.pack('<q', value))
  with pytest.raises(DataError, match=r'good.idx: ' + message):
    indexed.IndexedDataset(good)


def test_garbage_body_is_one_error_naming_a_record(good):
  body = np.random.default_rng(0).integers(0, 256, 12 * len(DOCS) + 8 * (len(DOCS) + 1), np.uint8)
  patch(good + '.idx', 34, body.tobytes())
  with pytest.raises(DataError, match=r'good.idx: (sequence|document index entry) \d+ of'):
    indexed.IndexedDataset(good)


def corrupt_corpus(prefix):
  """A valid header and a consistent last record, but one absurd size mid-file: before the
  checks this opened fine and then built gigabytes of sample index."""
  indexed.write(prefix, [[1, 2, 3, 4, 5]] * 100, np.uint16)
  patch(prefix + '.idx', sizes_at(50), struct.pack('<i', 2**31 - 1))


def test_gpt_dataset_fails_before_writing_an_index_cache(tmp_path):
  prefix, cache = str(tmp_path / 'corrupt'), tmp_path / 'cache'
  corrupt_corpus(prefix)
  with pytest.raises(DataError, match=r'corrupt.idx: sequence 50 of 100: its bytes'):
    gpt_dataset.GPTDataset(prefix, 'train', 8, 1234, '1,0,0', cache_dir=str(cache))
  assert not list(cache.rglob('*.npy')) and not list(tmp_path.rglob('*.npy'))


def write_raw(prefix, sizes, dtype=np.uint16):
  """.idx bytes straight from numpy (one document per sequence) and a sparse .bin: builds
  a million-document dataset in milliseconds where the writer's per-document loop cannot."""
  item = np.dtype(dtype).itemsize
  sizes = np.asarray(sizes, np.int32)
  pointers = np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64) * item))
  doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
  header = (indexed.MAGIC + struct.pack('<QBQQ', indexed.VERSION,
                                        indexed.CODE_OF_DTYPE[np.dtype(dtype)],
                                        len(sizes), len(doc_idx)))
  with open(prefix + '.idx', 'wb') as f:
    for part in (header, sizes.tobytes(), pointers.tobytes(), doc_idx.tobytes()):
      f.write(part)
  with open(prefix + '.bin', 'wb') as f:
    f.truncate(int(sizes.sum(dtype=np.int64)) * item)


def test_a_million_document_index_opens(tmp_path):
  prefix = str(tmp_path / 'million')
  n = 1_000_000
  write_raw(prefix, np.arange(n) % 7)
  ds = indexed.IndexedDataset(prefix)
  assert len(ds) == ds.num_documents == n
  assert ds.tokens.size == os.path.getsize(prefix + '.bin') // 2 == 3 * n - 3
  assert ds.get(n - 2).tolist() == [0] * 6   # sizes cycle 0..6; the sparse .bin reads 0s
