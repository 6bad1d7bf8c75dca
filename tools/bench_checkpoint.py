"""Measure checkpoint save/load on this machine (one process):

    python -m tools.bench_checkpoint [--mb=200] [--dir=/tmp/x]

Prints save and load throughput, how long save() blocks (sync vs async), peak extra host
memory during a save (RSS sampled by a thread, above the RSS before save()), and the files
per checkpoint with per-rank OCDBT databases vs one file per chunk (plain `file` kvstore).
"""
import os
import tempfile
import threading
import time

from absl import app, flags
import tensorstore as ts
import torch

import tools
from checkpoint import manager, storage, store

FLAGS = flags.FLAGS


def llama_like_arrays(total_mb):
  """Square-ish fp32 matrices (4 MiB .. 16 MiB) and small norms, like a small Llama's."""
  arrays, size, i = {}, 0, 0
  while size < total_mb * 2**20:
    rows = (1024, 2048, 4096)[i % 3]
    arrays[f'layers.{i}.mlp.weight'] = torch.randn(rows, 1024)
    arrays[f'layers.{i}.norm.weight'] = torch.ones(1024)
    size += (rows + 1) * 1024 * 4
    i += 1
  return arrays, size


def full_layout(arrays, ranks=1):
  """Rows split evenly over `ranks` writers (norms replicated: written by rank 0)."""
  layout = {}
  for name, t in arrays.items():
    rows = t.shape[0] // ranks
    boxes = ([(slice(r * rows, (r + 1) * rows), slice(None)) for r in range(ranks)] if t.dim() == 2
             else [(slice(None),)] * ranks)
    layout[name] = store.ArrayLayout.from_boxes(t.shape, 'float32', boxes)
  return layout


def rss_bytes():
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class PeakRss:
  """Samples RSS in a thread (every 2 ms) until stopped; a measurement tool, not a test."""

  def __enter__(self):
    self.base, self.peak, self._stop = rss_bytes(), 0, threading.Event()
    self._thread = threading.Thread(target=self._sample)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, rss_bytes())

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, rss_bytes())


def count_files(path):
  return sum(len(files) for _, _, files in os.walk(path))


def plain_file_count(path, arrays, layout):
  """Files the same arrays take as zarr3 on the plain `file` kvstore (one per chunk)."""
  context = ts.Context()
  for name, t in arrays.items():
    spec = store._zarr_spec({'driver': 'ocdbt'}, name, layout[name])  # pylint: disable=protected-access
    spec['kvstore'] = storage.kvstore_spec(storage.join(path, name))
    ts.open(spec, create=True, context=context).result().write(store.to_numpy(t)).result()
  return count_files(path)


def define_flags():
  flags.DEFINE_integer('mb', 200, 'MiB of arrays to save and load.')
  flags.DEFINE_string('dir', None, 'Write the checkpoints here (default: a new temporary directory).')


def main(argv):
  tools.no_arguments(argv)
  root = FLAGS.dir or tempfile.mkdtemp(prefix='ckpt_bench_')
  arrays, nbytes = llama_like_arrays(FLAGS.mb)
  layout, mb = full_layout(arrays), nbytes / 2**20
  print(f'{len(arrays)} arrays, {mb:.0f} MiB, in {root}')

  sync = manager.CheckpointManager(os.path.join(root, 'sync'), save_top_k=1)
  with PeakRss() as rss:
    start = time.perf_counter()
    sync.save(1, arrays, layout)
    save_s = time.perf_counter() - start
  print(f'sync save: {mb / save_s:.0f} MiB/s ({save_s:.2f} s blocking); '
        f'peak extra RSS {(rss.peak - rss.base) / 2**20:.0f} MiB')

  asyn = manager.CheckpointManager(os.path.join(root, 'async'), save_top_k=1, async_save=True)
  with PeakRss() as rss:
    start = time.perf_counter()
    asyn.save(1, arrays, layout)
    blocked_s = time.perf_counter() - start
    asyn.wait()
    total_s = time.perf_counter() - start
  print(f'async save: save() blocked {blocked_s:.2f} s, done after {total_s:.2f} s; '
        f'peak extra RSS {(rss.peak - rss.base) / 2**20:.0f} MiB')

  requests = {name: (slice(None),) * t.dim() for name, t in arrays.items()}
  start = time.perf_counter()
  loaded, _ = sync.load(1, requests)
  load_s = time.perf_counter() - start
  assert all(torch.equal(loaded[n], arrays[n]) for n in arrays)
  print(f'load: {mb / load_s:.0f} MiB/s ({load_s:.2f} s)')

  print(f'files per checkpoint, 1 writer: {count_files(sync.step_path(1))} (OCDBT) vs '
        f'{plain_file_count(os.path.join(root, "plain"), arrays, layout)} (plain file kvstore)')
  four = full_layout(arrays, ranks=4)
  path = os.path.join(root, 'four_ranks')
  for rank in range(4):
    mine = {n: arrays[n][tuple(slice(a, b) for a, b in four[n].box_of(rank))]
            for n in arrays if four[n].box_of(rank) is not None}
    store.write_local(path, mine, four, rank)
  store.merge(path, four)
  store.verify(path, four)
  print(f'files per checkpoint, 4 writers: {count_files(path)} (OCDBT)')


if __name__ == '__main__':
  define_flags()
  app.run(main)
