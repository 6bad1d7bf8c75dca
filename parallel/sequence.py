"""Sequence parallelism's column linears that keep the shard (Megatron-LM's
LinearWithGradAccumulationAndAsyncCommunication, Korthikanti et al. 2022).

Under SP the linear layers read the whole sequence: `gather` all-gathers the rank's shard of it.
A plain F.linear would then save that gathered input, s b h per rank whatever the TP degree.
`linear` saves nothing of it: its backward gathers the shard again (the same collective on
the same values, so the same bits) and computes the input and weight gradients with the very
GEMMs autograd's own linear backward runs (mm_mat1_backward / mm_mat2_backward's row-major
cases), so every gradient is bitwise what it was. The linears that read one gathered input
(q, k, v; gate, up) share one gather in the backward: the first to need it gathers, the
others reuse it until the last is done.

Where the gathered input is also read by something else (a LoRA adapter's A, the MoE router
and experts, the chunked cross-entropy), that reader keeps it as before; under autocast the
linears run as F.linear (autocast's casts are what its backward needs).
"""
import torch
import torch.nn.functional as F

from numerics import fp8


class _Regather:
  """The gathered input, built again from the saved shard on first use in the backward and
  shared by the linears that read it: each reader counts itself in (forward) and out
  (backward), and the last one out drops it, so one layer's input is held at a time."""

  def __init__(self, build):
    self.build, self.full, self.readers = build, None, 0

  def take(self, shard):
    full = self.full
    if full is None:
      with torch.no_grad():
        full = self.build(shard)
    self.readers -= 1
    self.full = full if self.readers > 0 else None
    return full


def gather(x_shard, build):
  """`build(x_shard)` (the all-gather of the sequence, with its dtype casts), tagged so that
  `linear` can save the shard instead of the result."""
  full = build(x_shard)
  if torch.is_grad_enabled() and full.requires_grad:
    full._flatron_shard = (x_shard.detach(), _Regather(build))   # pylint: disable=protected-access
  return full


class _KeepShardLinear(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x, w, b, shard, regather, gemms):  # pylint: disable=arguments-differ
    # the shard is saved as a tensor, so that recompute (torch.utils.checkpoint) drops and restores it
    ctx.regather, ctx.x_shape, ctx.has_bias, ctx.gemms = regather, x.shape, b is not None, gemms
    ctx.save_for_backward(w, shard)
    if ctx.needs_input_grad[1]:     # a frozen weight (LoRA's base) needs no input in backward
      regather.readers += 1
    if gemms is None:
      return F.linear(x, w, b)
    out = gemms.forward(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b.to(out.dtype)

  @staticmethod
  def backward(ctx, grad):  # pylint: disable=arguments-differ
    w, shard = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = grad_b = None
    gemms = ctx.gemms
    if ctx.needs_input_grad[0]:
      grad_x = (g2.mm(w) if gemms is None else gemms.grad_input(g2, w)).view(ctx.x_shape)
    if ctx.needs_input_grad[1]:
      x = ctx.regather.take(shard).reshape(-1, ctx.x_shape[-1])
      grad_w = g2.t().mm(x) if gemms is None else gemms.grad_weight(g2, x)
    if ctx.has_bias and ctx.needs_input_grad[2]:
      grad_b = g2.sum(0)
    return grad_x, grad_w, grad_b, None, None, None


def linear(x, w, b=None, gemms=None):
  """F.linear(x, w, b) (in float8 with numerics/fp8.py's `gemms`), saving the shard `x` was
  gathered from (when `gather` made it)."""
  tagged = getattr(x, '_flatron_shard', None)
  # [b, s, h] and contiguous (as gathered): F.linear's own path is then addmm / mm on its 2-D view
  if tagged is None or torch.is_autocast_enabled(x.device.type) or x.dim() != 3 or not x.is_contiguous():
    return fp8.linear(x, w, b, gemms)
  return _KeepShardLinear.apply(x, w, b, *tagged, gemms)
