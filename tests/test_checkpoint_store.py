"""checkpoint/store.py: arrays written as boxes by many ranks read back as any other boxes;
chunking rule; errors that name the array (checksum, missing array, bad box, dtype)."""
import datetime
import glob
import math
import os

import pytest
import tensorstore as ts
import torch
import torch.distributed as dist

from checkpoint import storage, store
from tests import world


def global_arrays():
  """The arrays every rank knows in full (the test's ground truth)."""
  g = torch.Generator().manual_seed(0)
  return {'layers.0.w': torch.randn(8, 12, generator=g),
          'embed': torch.randn(16, 6, generator=g).bfloat16(),
          'counts': torch.arange(10, dtype=torch.int64) * 7,
          'step': torch.tensor(3.0),
          'optim/exp_avg/layers.0.w': torch.randn(6, 4, generator=g)}


def write_layout():
  """4 ranks: 2x2 tiles, row stripes, a replicated vector and scalar, uneven (ZeRO-like) rows."""
  tiles = [(slice(4 * (r // 2), 4 * (r // 2) + 4), slice(6 * (r % 2), 6 * (r % 2) + 6)) for r in range(4)]
  stripes = [(slice(4 * r, 4 * r + 4), slice(None)) for r in range(4)]
  uneven = [(slice(a, b), slice(None)) for a, b in ((0, 2), (2, 4), (4, 5), (5, 6))]
  boxes = {'layers.0.w': tiles, 'embed': stripes, 'counts': [(slice(None),)] * 4, 'step': [()] * 4,
           'optim/exp_avg/layers.0.w': uneven}
  full = global_arrays()
  return ({name: store.ArrayLayout.from_boxes(full[name].shape, store.dtype_name(full[name]), b)
           for name, b in boxes.items()}, boxes)


def read_boxes(rank):
  """A different layout: row stripes, 2x2 tiles, overlapping windows, column slices."""
  return {'layers.0.w': (slice(2 * rank, 2 * rank + 2), slice(None)),
          'embed': (slice(8 * (rank // 2), 8 * (rank // 2) + 8), slice(3 * (rank % 2), 3 * (rank % 2) + 3)),
          'counts': (slice(rank, rank + 6),),
          'step': (),
          'optim/exp_avg/layers.0.w': (slice(None), slice(rank, rank + 1))}


def _save_and_read(path):
  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))
  rank, full = dist.get_rank(), global_arrays()
  layout, boxes = write_layout()
  store.write_local(path, {name: full[name][boxes[name][rank]] for name in full}, layout, rank)
  dist.barrier()
  if rank == 0:
    store.merge(path, layout)
    store.verify(path, layout)
  dist.barrier()
  got = store.load_arrays(path, read_boxes(rank))
  return [name for name, box in read_boxes(rank).items()
          if got[name].dtype != full[name].dtype or not torch.equal(got[name], full[name][box])]


def _keys_of_rank(path, rank):
  db = store._db(path, rank)  # pylint: disable=protected-access
  return {k.decode().split('/')[0] for k in ts.KvStore.open(db).result().list().result()}


def test_boxes_written_by_four_ranks_read_back_in_another_layout(tmp_path):
  assert world.run(_save_and_read, 4, str(tmp_path)) == [[], [], [], []]
  # Replicated arrays went to rank 0's database only; each tile to its own rank's.
  assert {'counts', 'step', 'layers.0.w'} <= _keys_of_rank(str(tmp_path), 0)
  for rank in (1, 2, 3):
    assert _keys_of_rank(str(tmp_path), rank) == {'layers.0.w', 'embed', 'optim%2Fexp_avg%2Flayers.0.w'}
  assert sorted(store.array_names(str(tmp_path))) == sorted(global_arrays())


def test_chunks_divide_every_writer_box_and_stay_under_4_mib():
  cases = [((128256, 4096), 'float32', [(slice(r * 16032, (r + 1) * 16032), slice(None)) for r in range(8)]),
           ((4096, 14336), 'bfloat16', [(slice(None), slice(r * 1792, (r + 1) * 1792)) for r in range(8)]),
           ((1 << 22,), 'float32', [(slice(None),)]),        # 16 MiB vector: split along its one dim
           ((12, 4), 'float32', [(slice(0, 5), slice(None)), (slice(5, 10), slice(None)),
                                 (slice(10, 12), slice(None))])]
  for shape, dtype, boxes in cases:
    layout = store.ArrayLayout.from_boxes(shape, dtype, boxes)
    chunk = store.chunk_shape(layout)
    assert math.prod(chunk) * (2 if dtype == 'bfloat16' else 4) <= store.CHUNK_BYTES
    for _, box in layout.writers:
      assert all(a % c == 0 and (b % c == 0 or b == n) for (a, b), c, n in zip(box, chunk, shape))
  assert store.chunk_shape(store.ArrayLayout.from_boxes((12, 4), 'float32', cases[-1][2])) == (1, 4)
  assert store.chunk_shape(store.ArrayLayout.from_boxes(*cases[0])) == (167, 4096)


def test_replicated_boxes_have_one_writer_and_bad_tilings_are_refused():
  layout = store.ArrayLayout.from_boxes((4, 2), 'float32', [None, (slice(0, 2), slice(None)),
                                                            (slice(2, 4), slice(None)), (slice(0, 2), slice(None))])
  assert layout.writers == ((1, ((0, 2), (0, 2))), (2, ((2, 4), (0, 2))))
  overlap = store.ArrayLayout.from_boxes((4,), 'float32', [(slice(0, 3),), (slice(2, 4),)])
  with pytest.raises(ValueError, match='overlap'):
    store.chunk_shape(overlap, 'x')
  gap = store.ArrayLayout.from_boxes((4,), 'float32', [(slice(0, 1),), (slice(2, 4),)])
  with pytest.raises(ValueError, match='gaps'):
    store.chunk_shape(gap, 'x')


def save_single(path, arrays):
  """One process writes whole arrays (rank 0) and merges: a complete checkpoint."""
  layout = {n: store.ArrayLayout.from_boxes(t.shape, store.dtype_name(t), [(slice(None),) * t.dim()])
            for n, t in arrays.items()}
  store.write_local(path, arrays, layout, 0)
  store.merge(path, layout)
  store.verify(path, layout)
  return layout


def flip_byte_of(path, raw: bytes):
  """Flip one byte inside the stored copy of `raw` (found in the checkpoint's data files)."""
  for name in glob.glob(os.path.join(path, '**', 'd', '*'), recursive=True):
    data = bytearray(open(name, 'rb').read())
    if (at := data.find(raw)) >= 0:
      data[at + len(raw) // 2] ^= 0xFF
      open(name, 'wb').write(bytes(data))
      return
  raise AssertionError('bytes not found in any data file')


def test_a_flipped_byte_is_a_checksum_error_naming_the_array(tmp_path):
  arrays = {'good': torch.randn(64, 32), 'layers.3.mlp.down.weight': torch.randn(64, 32)}
  save_single(str(tmp_path), arrays)
  flip_byte_of(str(tmp_path), arrays['layers.3.mlp.down.weight'][10].numpy().tobytes())
  full = (slice(None), slice(None))
  assert torch.equal(store.load_arrays(str(tmp_path), {'good': full})['good'], arrays['good'])
  with pytest.raises(store.ChecksumError, match=r"'layers.3.mlp.down.weight'.*checksum"):
    store.load_arrays(str(tmp_path), {'layers.3.mlp.down.weight': full})


def test_missing_array_bad_box_and_dtype_are_clear_errors(tmp_path):
  save_single(str(tmp_path), {'a.weight': torch.zeros(4, 2), 'b.bias': torch.zeros(3)})
  with pytest.raises(store.MissingArrayError, match=r"'c.weight' is not in .* 2 arrays.*'a.weight', 'b.bias'"):
    store.load_arrays(str(tmp_path), {'c.weight': (slice(None),)})
  with pytest.raises(ValueError, match=r'outside its stored shape \(4, 2\)'):
    store.load_arrays(str(tmp_path), {'a.weight': (slice(2, 6), slice(None))})
  with pytest.raises(ValueError, match='stored as float32, expected bfloat16'):
    store.load_arrays(str(tmp_path), {'b.bias': (slice(None),)}, dtypes={'b.bias': torch.bfloat16})


def test_a_rank_that_wrote_nothing_fails_verification(tmp_path):
  layout = {'w': store.ArrayLayout.from_boxes((4, 2), 'float32', [(slice(0, 2), slice(None)),
                                                                    (slice(2, 4), slice(None))])}
  store.write_local(str(tmp_path), {'w': torch.zeros(2, 2)}, layout, 0)   # rank 1 never writes
  store.merge(str(tmp_path), layout)
  with pytest.raises(store.CheckpointError, match=r"'w' has 2 stored keys, expected zarr.json \+ 2 chunks"):
    store.verify(str(tmp_path), layout)


def test_a_box_of_the_wrong_shape_or_dtype_is_refused_before_writing(tmp_path):
  layout = {'w': store.ArrayLayout.from_boxes((4, 2), 'float32', [(slice(None), slice(None))])}
  with pytest.raises(ValueError, match=r'writes box .* as float32 but its tensor is bfloat16\(4, 2\)'):
    store.write_local(str(tmp_path), {'w': torch.zeros(4, 2, dtype=torch.bfloat16)}, layout, 0)


def test_paths_map_to_tensorstore_kvstores(monkeypatch):
  for var in ('AWS_ENDPOINT_URL', 'AWS_ENDPOINT_URL_S3'):
    monkeypatch.delenv(var, raising=False)
  assert storage.kvstore_spec('s3://bkt/runs/a') == {'driver': 's3', 'bucket': 'bkt', 'path': 'runs/a/'}
  assert storage.kvstore_spec('gs://bkt/runs/a/') == {'driver': 'gcs', 'bucket': 'bkt', 'path': 'runs/a/'}
  assert storage.kvstore_spec('/x/runs/a') == {'driver': 'file', 'path': '/x/runs/a/'}
  monkeypatch.setenv('AWS_ENDPOINT_URL', 'http://127.0.0.1:9000')   # S3-compatible servers
  assert storage.kvstore_spec('s3://bkt/a')['endpoint'] == 'http://127.0.0.1:9000'
