"""The arrays of one checkpoint: each stored once, in its global logical shape, under its
global name, so any parallel layout can read back any box of it.

On disk, `<path>/arrays/` is one OCDBT database (tensorstore's B+tree key-value store):

    arrays/manifest.ocdbt, arrays/d/...     the root database, made by rank 0's `merge`
    arrays/ocdbt.process_<rank>/...         what each writing rank wrote; the root references
                                            these data files, so they are part of the checkpoint

Each array is a zarr3 array under the key `<quoted name>/` (zarr.json, then chunks
`c/<i>/<j>...`). Names are quoted with urllib.parse.quote(name, safe=''): letters, digits and
`._-~` stay (so `layers.0.self_attn.q_proj.weight` is stored as is), anything else - `/`
included - becomes %XX, so one array's keys can never be a prefix of another's.

Why per-rank OCDBT databases, not one file per chunk: every rank writes its own database (no
two processes ever write the same file), then rank 0 merges them by reference
(`experimental_copy_range_to`, no data copied). A checkpoint is then ~3 files per writing rank
(manifest, B+tree data, chunk data; data files roll over at 2 GiB) plus ~2 for the root,
whatever the number of arrays and chunks. The plain `file` kvstore makes one file per chunk
plus one per array: measured by tools/bench_checkpoint.py for 44 arrays / 200 MiB, 8 array files
(10 with metadata.json and COMMITTED) vs 116 with 1 writer; 4 writers: 20 files in all.
Remote stores work the same (tested on S3 through moto); OCDBT there also saves requests.

Integrity: every chunk ends in a crc32c (the zarr3 `crc32c` codec) and OCDBT checks its own
nodes; tensorstore reports a mismatch as DATA_LOSS, raised here as ChecksumError naming the
array. A missing chunk is an error too (`fill_missing_data_reads: False`), never silent zeros.

A fresh ts.Context per call: a reused one keeps growing (its cache pools are never released).
"""
import math
import urllib.parse

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

from checkpoint import array_layout, storage
import user_errors
from user_errors import UserError

CODECS = [{'name': 'bytes', 'configuration': {'endian': 'little'}}, {'name': 'crc32c'}]
# Small values (zarr.json) inline in the B+tree; one big root node (fast listing); one writer
# per database, so the simple single-file manifest (as Orbax does).
OCDBT_CONFIG = {'max_inline_value_bytes': 1024, 'max_decoded_node_bytes': 100_000_000,
                'manifest_kind': 'single'}

# The layout vocabulary (array_layout.py), still reachable as store.X by its many callers.
ArrayLayout, CHUNK_BYTES, DTYPES = array_layout.ArrayLayout, array_layout.CHUNK_BYTES, array_layout.DTYPES
chunk_shape, dtype_name, normalize_box = array_layout.chunk_shape, array_layout.dtype_name, array_layout.normalize_box


class CheckpointError(UserError, RuntimeError):
  """The checkpoint cannot be read as asked: corrupt, incomplete or missing data."""


class MissingArrayError(CheckpointError):
  pass


class ChecksumError(CheckpointError):
  pass


def _box_slices(pairs):
  return tuple(slice(a, b) for a, b in pairs)


def _key(name):
  if not name:
    raise ValueError('array names must be non-empty')
  return urllib.parse.quote(name, safe='') + '/'


def _db(path, rank=None, writing=False):
  sub = f'arrays/ocdbt.process_{rank}' if rank is not None else 'arrays'
  spec = {'driver': 'ocdbt', 'base': storage.kvstore_spec(storage.join(path, sub))}
  if writing:  # assume_config: no initial empty manifest; each database has one writer
    spec.update(config=OCDBT_CONFIG, assume_config=True)
  return spec


def _zarr_spec(db, name, layout=None):
  spec = {'driver': 'zarr3', 'kvstore': dict(db, path=_key(name))}
  if layout is not None:  # writing: all-zero chunks too (else they are skipped, then "missing")
    spec['store_data_equal_to_fill_value'] = True
    spec['metadata'] = {'shape': list(layout.shape), 'data_type': layout.dtype, 'codecs': CODECS,
                        'chunk_grid': {'name': 'regular',
                                       'configuration': {'chunk_shape': list(chunk_shape(layout, name))}}}
  return spec


def to_numpy(t: torch.Tensor) -> np.ndarray:
  """A numpy view of a CPU tensor (bf16 through ml_dtypes, which tensorstore uses)."""
  t = t.detach().contiguous()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
  a = a if a.flags.c_contiguous else a.copy()  # (np.ascontiguousarray makes scalars 1-d)
  if a.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(a)


DAMAGED = 'the step is damaged: use an earlier one (resume moves it aside and takes the one before)'


def _error(path, name, err, verb='read'):
  msg = user_errors.shorten(str(err))
  if 'DATA_LOSS' in msg:
    return ChecksumError(f'array {name!r} in checkpoint {path} is corrupt (checksum mismatch: {msg}); {DAMAGED}')
  if verb == 'read' and ('OUT_OF_RANGE' in msg or 'FAILED_PRECONDITION' in msg):    # a data file cut short or gone
    return ChecksumError(f'array {name!r} in checkpoint {path} could not be read ({msg}); {DAMAGED}')
  return CheckpointError(f'array {name!r} in checkpoint {path} could not be {verb}: {msg}')


def write_local(path, tensors: dict, layout: dict, rank: int):
  """Write the boxes `rank` writes (ArrayLayout.writers) into its own database; rank 0 also
  writes every array's zarr.json. `tensors` holds this rank's CPU tensors (at least those it
  writes; the others are ignored). Returns the number of bytes written."""
  mine = {name for name, lay in layout.items() if lay.box_of(rank) is not None}
  if missing := sorted(mine - set(tensors)):
    raise ValueError(f'rank {rank} writes {missing[:5]} but was not given them')
  names = sorted(layout) if rank == 0 else sorted(mine)
  if not names:
    return 0
  context, db = ts.Context(), _db(path, rank, writing=True)
  opens = {}
  for name in names:
    mode = dict(create=True) if rank == 0 else dict(open=True, assume_metadata=True)
    opens[name] = ts.open(_zarr_spec(db, name, layout[name]), context=context, **mode)
  writes, nbytes = {}, 0
  for name in sorted(mine):
    lay, t = layout[name], tensors[name]
    box = lay.box_of(rank)
    if tuple(t.shape) != tuple(b - a for a, b in box) or dtype_name(t) != lay.dtype:
      raise ValueError(f'{name}: rank {rank} writes box {box} as {lay.dtype} but its tensor is '
                       f'{dtype_name(t)}{tuple(t.shape)}')
    source = to_numpy(t.cpu())
    nbytes += source.nbytes
    try:
      # The caller keeps `tensors` alive and unchanged until this returns: no extra copy.
      writes[name] = opens[name].result()[_box_slices(box)].write(
          source, can_reference_source_data_indefinitely=True)
    except ValueError as err:
      _settle(opens, writes)
      raise _error(path, name, err, 'written') from err
  for name in names:
    try:
      opens[name].result()
      if name in writes:
        writes[name].result()
    except ValueError as err:
      _settle(opens, writes)
      raise _error(path, name, err, 'written') from err
  return nbytes


def _settle(*futures):
  """Wait out every write still in flight after one failed (their own errors are the same fault's),
  so nothing lands in the step's directory after the caller has deleted it."""
  for group in futures:
    for future in group.values():
      try:
        future.result()
      except ValueError:
        pass


def writer_ranks(layout: dict) -> list:
  return sorted({0} | {rank for lay in layout.values() for rank, _ in lay.writers})


def merge(path, layout: dict):
  """Rank 0, after every rank's write_local returned: one root database referencing all the
  per-rank ones (no data copied), committed atomically."""
  context = ts.Context()
  root = ts.KvStore.open(_db(path, writing=True), context=context).result()
  txn = ts.Transaction(atomic=True)
  copies = []
  for rank in writer_ranks(layout):
    child = ts.KvStore.open(_db(path, rank), context=context).result()
    copies.append(child.experimental_copy_range_to(root.with_transaction(txn)))
  for copy in copies:
    copy.result()
  txn.commit_async().result()


def _stored_keys(path):
  """name -> number of stored keys (zarr.json and chunks) of every array in the root."""
  try:
    keys = ts.KvStore.open(_db(path), context=ts.Context()).result().list().result()
  except ValueError as err:      # the array index itself is damaged (cut short, bytes flipped)
    raise ChecksumError(f'checkpoint {path}: its array index could not be read ({str(err)[:200]}); {DAMAGED}') from err
  counts = {}
  for key in keys:
    quoted, _, _ = key.decode().partition('/')
    name = urllib.parse.unquote(quoted)
    counts[name] = counts.get(name, 0) + 1
  return counts


def array_names(path) -> list:
  return sorted(_stored_keys(path))


def verify(path, layout: dict):
  """Rank 0, after merge: every array has its metadata and every chunk (a rank that silently
  wrote nothing must not produce a checkpoint that loads as zeros)."""
  counts = _stored_keys(path)
  for name, lay in sorted(layout.items()):
    chunks = math.prod(-(-n // c) for n, c in zip(lay.shape, chunk_shape(lay, name)))
    if counts.get(name, 0) != 1 + chunks:
      raise CheckpointError(f'checkpoint {path}: array {name!r} has {counts.get(name, 0)} stored '
                            f'keys, expected zarr.json + {chunks} chunks')


def load_arrays(path, requests: dict, dtypes: dict = None) -> dict:
  """{name: box} -> {name: CPU tensor of exactly that box}, in the stored dtype; `dtypes`
  ({name: dtype}) makes a different stored dtype an error."""
  context, db = ts.Context(), _db(path)
  opens = {name: ts.open(dict(_zarr_spec(db, name), fill_missing_data_reads=False), open=True,
                         read=True, context=context) for name in requests}
  reads = {}
  for name, box in requests.items():
    try:
      array = opens[name].result()
    except ValueError as err:
      if 'NOT_FOUND' not in str(err):
        raise _error(path, name, err) from err
      available = array_names(path)
      raise MissingArrayError(f'array {name!r} is not in checkpoint {path}; it has {len(available)} '
                              f'arrays, e.g. {available[:5]}') from err
    shape, dtype = tuple(array.shape), array.dtype.name
    expected = str(dtypes[name]).removeprefix('torch.') if dtypes and name in dtypes else dtype
    if expected != dtype:
      raise ValueError(f'array {name!r} is stored as {dtype}, expected {expected}')
    pairs = normalize_box(box, shape)
    if any(not 0 <= a <= b <= n for (a, b), n in zip(pairs, shape)):
      raise ValueError(f'box {pairs} of array {name!r} lies outside its stored shape {shape}')
    reads[name] = array[_box_slices(pairs)].read()
  out = {}
  for name, read in reads.items():
    try:
      out[name] = to_torch(read.result())
    except ValueError as err:
      raise _error(path, name, err) from err
  return out
