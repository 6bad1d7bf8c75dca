"""Initial values as pure functions of (seed, a parameter's name): any box of any parameter
(a TP / EP rank's shard) is drawn alone and equals the same slice of the whole tensor."""
import torch

import rng
import host_values

INIT_ROWS_PER_KEY = 64     # init draws rows in keyed blocks, so a shard can draw only its rows


def full_box(shape) -> tuple:
  return tuple(slice(0, n) for n in shape)


def init_box(spec, seed: int, name: str, box=None) -> torch.Tensor:
  """The `box` (one slice per dim) of parameter `name`'s initial value, drawing only its rows.

  Normal weights are drawn in blocks of INIT_ROWS_PER_KEY rows keyed by (seed, name, block),
  so any shard of any layout equals the same slice of the single-device tensor; a stack of
  experts [E, rows, cols] as E matrices keyed by (seed, name, expert, block).
  """
  box = box or full_box(spec.shape)
  shape = tuple(sl.stop - sl.start for sl in box)
  if host_values.tracing():      # a traced step's parameters have shapes, not values: nothing to draw
    host_values.note('the initial values are not drawn')
    return torch.empty(shape)
  if spec.init == 'ones':
    return torch.ones(shape)
  if spec.init == 'zeros':
    return torch.zeros(shape)
  if len(spec.shape) == 3:
    return torch.stack([_draw_rows(spec, spec.shape[1:], box[1:], seed, name, e)
                        for e in range(box[0].start, box[0].stop)])
  return _draw_rows(spec, spec.shape, box, seed, name)


def _draw_rows(spec, full_shape, box, seed, *key):
  """`box` of a matrix of `full_shape` drawn in keyed blocks of rows (init_box)."""
  rows, r = box[0], INIT_ROWS_PER_KEY
  first, shape = rows.start // r, (r,) + tuple(full_shape[1:])
  draw = ((lambda k: (2 * rng.uniform(shape, seed, 'init', *key, k) - 1) * spec.std) if spec.init == 'uniform'
          else (lambda k: rng.normal(shape, spec.std, seed, 'init', *key, k)))
  blocks = [draw(k)[(slice(None),) + tuple(box[1:])] for k in range(first, (rows.stop - 1) // r + 1)]
  drawn = torch.cat(blocks)
  out = drawn[rows.start - first * r:rows.stop - first * r]
  if out.numel() < drawn.numel():
    out = out.clone()     # a view would keep the whole blocks' rows alive with the parameter
  if spec.used_rows:
    out[max(spec.used_rows - rows.start, 0):] = 0.0
  return out
