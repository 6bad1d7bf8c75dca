"""FP8 linears with dynamic scaling (`precision.fp8`): the forward GEMM and both backward GEMMs
of a linear layer in float8, as torchao's Float8Linear computes them, bit for bit.

A tensor is scaled by `max_fp8 / amax` (amax of |x| over the whole tensor, `tensorwise`, or per
row / column, `rowwise`), cast to float8 with saturation, and multiplied by
`torch._scaled_mm`, which undoes the scales. Recipes (torchao's `from_recipe_name`):

| recipe     | input, weight | grad_output | scales                 | GEMM accumulation
|------------|---------------|-------------|------------------------|------------------------------
| tensorwise | e4m3, 1 each  | e5m2, 1     | max_fp8 / amax         | forward fast, backward exact
| rowwise    | e4m3, per row | e4m3, per row | rounded down to 2^k  | forward fast, backward exact, then scaled

Nothing is kept beyond what a high-precision linear keeps: the input and weight are saved as they
are and cast again in the backward (as torchao does), so checkpoints, memory and the
activations of a run do not change with FP8.

Layouts: a linear's dims are M (tokens), K (input features), N (output features). An amax taken
over a dim that a parallel layout splits (N of a column-parallel weight, K of a row-parallel one,
M under context parallelism) is all-reduced with MAX over that group by the `reduce` callables
the caller passes ({'M': fn, 'K': fn, 'N': fn}; process groups are parallel/'s), so every layout
scales as one device does.
"""
import dataclasses

import torch

from user_errors import UserError

RECIPES = ('tensorwise', 'rowwise')
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12          # torchao's floor on amax


class Float8Unsupported(UserError, RuntimeError):
  """precision.fp8 on a device (or torch) without float8 GEMMs."""


@dataclasses.dataclass(frozen=True)
class Recipe:
  rowwise: bool
  grad_dtype: torch.dtype       # grad_output's float8 type
  power_of_2: bool              # scales rounded down to a power of 2


def recipe(name) -> Recipe:
  if name == 'tensorwise':
    return Recipe(rowwise=False, grad_dtype=E5M2, power_of_2=False)
  if name == 'rowwise':
    return Recipe(rowwise=True, grad_dtype=E4M3, power_of_2=True)
  raise ValueError(f'precision.fp8={name!r} is unknown; valid: {", ".join(RECIPES)} (or None: off)')


def _scale(amax, dtype, power_of_2):
  """max_fp8 / amax, in float64 then float32 (so eager and compiled code agree, as torchao)."""
  scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
  return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


@torch.no_grad()
def cast(x, dtype, over, rec, reduce=None, dims=()):
  """(x scaled and cast to `dtype`, its scale). `over`: None (tensorwise) or the dim the amax
  runs over (rowwise: one scale per slice along the other dim); `dims`: the logical dims
  ('M', 'K', 'N') the amax covers, each all-reduced over the group that splits it."""
  amax = x.abs().max() if over is None else x.abs().amax(dim=over, keepdim=True)
  for dim in dims:
    if reduce and reduce.get(dim):
      amax = reduce[dim](amax)
  scale = _scale(amax, dtype, rec.power_of_2)
  fmax = torch.finfo(dtype).max
  return (x.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype), scale


def _mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
  """torch._scaled_mm as torchao's addmm_float8_unwrapped calls it: `a` row-major, `b`
  column-major; rowwise without fast accumulation multiplies the scales in afterwards."""
  a = a if a.stride(-1) == 1 else a.contiguous()
  b = b if b.stride(0) == 1 else b.t().contiguous().t()
  a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
  rowwise = a_scale.dim() == 2
  post = None
  if rowwise and not fast_accum:
    post, a_inv, b_inv = a_inv * b_inv, a_inv.new_ones(()), a_inv.new_ones(())
  mm_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
  out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,  # pylint: disable=protected-access
                         use_fast_accum=fast_accum)
  if post is not None:
    out *= post
  return out.to(out_dtype)


@dataclasses.dataclass(frozen=True)
class Gemms:
  """The three GEMMs of a linear y = x w^T, in float8 with `rec`'s scaling, x as [M, K] and w
  as [N, K]; `reduce` completes amaxes over split dims (see the module docstring)."""
  rec: Recipe
  reduce: dict = None

  def _cast(self, t, dims, axis, dtype=E4M3):
    """`t` [dims[0], dims[1]] cast with one scale, or (rowwise) with one per slice, its amax over
    `axis` (a tensorwise scale is 0-dim: its .t() is itself)."""
    r = self.rec
    return cast(t, dtype, axis if r.rowwise else None, r, self.reduce, (dims[axis],) if r.rowwise else dims)

  def forward(self, x2, w):
    xq, xs = self._cast(x2, ('M', 'K'), -1)
    wq, ws = self._cast(w, ('N', 'K'), -1)
    return _mm(xq, xs, wq.t(), ws.t(), x2.dtype, True)

  def grad_input(self, g2, w):
    gq, gs = self._cast(g2, ('M', 'N'), -1, self.rec.grad_dtype)
    wq, ws = self._cast(w, ('N', 'K'), 0)
    return _mm(gq, gs, wq, ws, g2.dtype, False)

  def grad_weight(self, g2, x2):
    gq, gs = self._cast(g2, ('M', 'N'), 0, self.rec.grad_dtype)
    xq, xs = self._cast(x2, ('M', 'K'), 0)
    return _mm(gq.t(), gs.t(), xq, xs, g2.dtype, False)


class _Float8Linear(torch.autograd.Function):
  """x [..., K] @ w[N, K]^T through `gemms`; saves x and w as they are (high precision)."""

  @staticmethod
  def forward(ctx, x, w, gemms):  # pylint: disable=arguments-differ
    ctx.save_for_backward(x, w)
    ctx.gemms = gemms
    return gemms.forward(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])

  @staticmethod
  def backward(ctx, grad):  # pylint: disable=arguments-differ
    x, w = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
      grad_x = ctx.gemms.grad_input(g2, w).view(x.shape)
    if ctx.needs_input_grad[1]:
      grad_w = ctx.gemms.grad_weight(g2, x.reshape(-1, x.shape[-1]))
    return grad_x, grad_w, None


def linear(x, w, b=None, gemms: Gemms = None):
  """F.linear(x, w, b) with its GEMMs in float8 (`gemms`; None: in x's dtype). Under autocast,
  the input runs in the autocast dtype and the weight is cast from its own (as torchao)."""
  if gemms is None:
    return torch.nn.functional.linear(x, w, b)
  if torch.is_autocast_enabled(x.device.type):
    x = x.to(torch.get_autocast_dtype(x.device.type))
  with torch.autocast(x.device.type, enabled=False):
    out = _Float8Linear.apply(x, w, gemms)
    return out if b is None else out + b.to(out.dtype)


def probe(device) -> str:
  """'' when `device` runs torch._scaled_mm on float8, else why not (one line)."""
  try:
    a = torch.ones(16, 16, device=device).to(E4M3)
    one = torch.ones((), device=device)
    torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # pylint: disable=protected-access
    return ''
  except (RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
