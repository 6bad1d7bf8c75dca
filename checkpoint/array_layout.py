"""Who writes which box of a checkpoint array, and the chunk grid that follows from it (store.py
writes and reads the arrays; this is the geometry both sides agree on, with no I/O): boxes as
(start, stop) pairs, ArrayLayout (global shape, dtype, writer boxes), the check that writer boxes
tile the array exactly once, and the chunking rule.

Chunking rule (`chunk_shape`): per dim, the gcd of the global size and every writer box's start
and stop, so every box is a union of whole chunks and no two ranks ever write one chunk; then,
while a chunk is over CHUNK_BYTES (4 MiB), dim 0 (then dim 1, ...) is cut to its largest divisor
that fits. Irregular splits (e.g. 5/5/2 rows) give gcd 1: one-row chunks, correct but many.
"""
import dataclasses
import functools
import math

import numpy as np
import torch

CHUNK_BYTES = 4 * 2**20
DTYPES = ('float32', 'bfloat16', 'float16', 'float64', 'int64', 'int32', 'int8', 'uint8', 'bool')


def normalize_box(box, shape) -> tuple:
  """A box (one slice, or (start, stop) pair, per dim) as a hashable tuple of int pairs."""
  if len(box) != len(shape):
    raise ValueError(f'box {box} has {len(box)} dims, the array has shape {tuple(shape)}')
  pairs = []
  for part, size in zip(box, shape):
    if isinstance(part, slice):
      if part.step not in (None, 1):
        raise ValueError(f'box {box}: slices must have step 1')
      start, stop = part.start or 0, size if part.stop is None else part.stop
    else:
      start, stop = part
    pairs.append((int(start), int(stop)))
  return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
  """An array's global logical shape, stored dtype, and who writes which box of it.

  writers: ((rank, box), ...) with boxes as (start, stop) pairs per dim; the boxes must tile
  the array exactly (each element written once). Build it with `from_boxes`.
  """
  shape: tuple
  dtype: str
  writers: tuple

  @classmethod
  def from_boxes(cls, shape, dtype, boxes_by_rank):
    """boxes_by_rank[r]: the box rank r holds, or None. Replicated boxes (the same box on
    several ranks) are written by the lowest rank holding them."""
    shape, first = tuple(int(n) for n in shape), {}
    for rank, box in enumerate(boxes_by_rank):
      if box is not None:
        first.setdefault(normalize_box(box, shape), rank)
    return cls(shape, str(dtype), tuple((rank, box) for box, rank in sorted(first.items(), key=lambda x: x[1])))

  def box_of(self, rank):
    return next((box for r, box in self.writers if r == rank), None)


def dtype_name(t: torch.Tensor) -> str:
  return str(t.dtype).removeprefix('torch.')


def _itemsize(dtype):
  return 2 if dtype == 'bfloat16' else np.dtype(dtype).itemsize


def _check_tiling(name, layout):
  """Writer boxes cover the array exactly once (counted on the grid of all box edges)."""
  boxes = [box for _, box in layout.writers if all(b > a for a, b in box)]
  cuts = [sorted({0, n} | {box[d][i] for box in boxes for i in (0, 1)}) for d, n in enumerate(layout.shape)]
  index = [{edge: i for i, edge in enumerate(c)} for c in cuts]
  times_written = np.zeros([len(c) - 1 for c in cuts], np.int64)
  for box in boxes:
    if any(a < 0 or b > n for (a, b), n in zip(box, layout.shape)):
      raise ValueError(f'{name}: writer box {box} lies outside the shape {layout.shape}')
    times_written[tuple(slice(at[a], at[b]) for (a, b), at in zip(box, index))] += 1
  if times_written.size and not (times_written == 1).all():
    what = 'overlap (two writers of one element)' if (times_written > 1).any() else 'leave gaps'
    raise ValueError(f'{name}: writer boxes {[b for _, b in layout.writers]} {what}')


def _largest_divisor_at_most(n, limit):
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return max(d for d in small + [n // d for d in small] if d <= max(limit, 1))


@functools.lru_cache(maxsize=None)
def chunk_shape(layout: ArrayLayout, name: str = '') -> tuple:
  """The chunking rule (module docstring); validates the writers' tiling on the way."""
  if layout.dtype not in DTYPES:
    raise ValueError(f'{name}: dtype {layout.dtype!r} is not one of {DTYPES}')
  _check_tiling(name, layout)
  chunk = [max(1, math.gcd(n, *(e for _, box in layout.writers for e in box[d])))
           for d, n in enumerate(layout.shape)]
  for d in range(len(chunk)):
    other_bytes = math.prod(chunk[:d] + chunk[d + 1:]) * _itemsize(layout.dtype)
    if other_bytes * chunk[d] <= CHUNK_BYTES:
      break
    chunk[d] = _largest_divisor_at_most(chunk[d], CHUNK_BYTES // other_bytes)
  return tuple(chunk)
