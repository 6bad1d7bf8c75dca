"""The 16-bit side of optim/update.py's Updater: which rows its one compiled pass per tensor
(optim/sr_update.py) steps and rounds itself, the fp32 working copies bf16SR's rows and moments
are widened to for the rest of a step, and their rounding back to the parameter dtype (to
nearest, or stochastically keyed by seed, step, name and each element's global index, so every
layout rounds alike). Kept apart from the step's order of clip, step and gather because it is
where the recipes differ; each function reads the Updater `u` it is given (its masters,
optimizer state, parameters, placement) and changes only the rows and state it says it does."""
import math

import torch

from numerics import precision, stochastic_rounding
from optim import sr_update
from parallel import comm


def fusable(u):
  """Names whose Adam(W) step is optim/sr_update.py's one compiled pass per tensor: bf16 rows
  without a master, stochastically rounded (bf16SR), and fp32 rows (fp32 parameters, masters)
  of parameters with at least precision.FUSED_FP32_MIN_NUMEL elements, on a device type that
  compiles them (sr_update.fusable)."""
  if not u.master:
    return frozenset()
  device = next(iter(u.master.values())).device
  fp32 = sr_update.fusable(u.optimizer, device, torch.float32)
  sr = u.recipe.stochastic_rounding and sr_update.fusable(u.optimizer, device)
  large = lambda n: math.prod(u.placement[n][1]) >= precision.FUSED_FP32_MIN_NUMEL
  return frozenset(n for n, m in u.master.items()
                   if (fp32 and large(n) if m.dtype == torch.float32 else sr))


def narrowed_in_pass(u):
  """Fused names whose fp32 master the pass itself rounds to nearest into the parameter (its
  own storage, the copy _update would make): masters of 16-bit parameters without ZeRO-1, where
  a rank owns every row; with ZeRO-1 the gather writes the rows and zeroes the others."""
  whole = {n for (_, parts, _), names in u.domains.items() if parts == 1 for n in names}
  return frozenset(n for n in u.fused if n in whole and not u.recipe.stochastic_rounding
                   and u.has_master_copy(n) and u.params[n].is_contiguous())


def widen(u, skip=()):
  """bf16 rows stepped without a master (bf16SR): fp32 working copies of the rows and their
  state for this update (but for `skip`). Returns the names widened."""
  narrow = [n for n, m in u.master.items() if m.dtype != torch.float32 and n not in skip]
  for n in narrow:
    m = u.master[n]
    for key in u._shaped_state(m):
      u.optimizer.state[m][key] = u.optimizer.state[m][key].float()
    m.data = m.float()
  return narrow


def round_back(u, narrow, fused, step):
  """After the optimizer step: the stepped rows of `u` (an Updater) in the parameter dtype, name ->
  rows for the gather (those rounded here), and the moments of `narrow` (widened for the step)
  rounded back into the optimizer state, their masters views of the parameters' rows again;
  `fused`: names the one pass stepped."""
  # Rows (and, widened for this step, moments) go back to the parameter dtype, all rounded
  # in one pass. Without ZeRO-1 an fp32 master is the parameter itself: no copy back.
  # Rounded to nearest, masters are rounded by the copy into the parameter (copy_ casts as
  # .to does, the same bits), not into a copy of their own first; the fused pass made that
  # copy already for narrowed_in_pass.
  written = u.narrowed_in_pass & fused
  rows = [(n, m, ()) for n, m in u.master.items() if m.dtype != u.params[n].dtype and n not in written]
  moments = [(n, u.optimizer.state[u.master[n]][key], (key,)) for n in narrow
             for key in u._shaped_state(u.master[n])]
  if u.recipe.stochastic_rounding:
    results = round_all(u, rows + moments, step)
  else:
    results = [m for _, m, _ in rows] + round_all(u, moments, step)
  rounded = {n: r for (n, _, _), r in zip(rows, results)}
  for (n, _, (key,)), r in zip(moments, results[len(rows):]):
    u.optimizer.state[u.master[n]][key] = r
  for n in narrow:
    u.master[n].data = u._owned(n)         # a view of the parameter's rows again
  return rounded


def round_all(u, items, step):
  """[(name, fp32 owned rows of name or their state, purpose)] in the parameter dtype:
  stochastically, keyed by (seed, step, name, purpose) and global element index, where the
  recipe says, else nearest. Rounded in buckets of bucket_bytes (on XLA one graph cut per
  bucket, not per tensor)."""
  if not u.recipe.stochastic_rounding:
    return [rows.to(u.params[n].dtype) for n, rows, _ in items]
  keyed = [(rows, *u._owned_box(n), (u.config.seed, 'sr', step, n, *purpose))
           for n, rows, purpose in items]
  if not keyed or keyed[0][0].device.type != 'xla':
    return [sr_update.round_at(x, box, shape, *key) for x, box, shape, key in keyed]  # one pass each
  out = []
  for bucket in comm.buckets(range(len(keyed)), [k[0].numel() * 4 for k in keyed], u.bucket_bytes):
    out += stochastic_rounding.stochastic_round_many([keyed[i] for i in bucket])
  return out
