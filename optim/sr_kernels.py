"""The fused update's kernels: pure tensor functions that optim/sr_update.py compiles (one
pass per tensor) or runs eagerly with the same bits: torch's single-tensor Adam(W) in fp32, op
for op, and keyed stochastic rounding back to bf16 (numerics/stochastic_rounding.py), written
for inductor (the int32 view of fp32)."""
import torch

from numerics import stochastic_rounding

_BF16_MAX = torch.finfo(torch.bfloat16).max


def _round(x, index, seed):
  """stochastic_round(x, noise_at(index, seed)), written for inductor: the int32 view of fp32."""
  bits = (x.view(torch.int32) + stochastic_rounding.noise_at(index, seed)) & -(1 << 16)
  rounded = bits.view(torch.float32).clamp(-_BF16_MAX, _BF16_MAX)
  return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def _round_kernel(x, layout, seed):
  return _round(x.float(), stochastic_rounding.index_from_layout(x.shape, layout), seed)


def _sqrt(x):
  """fp32 sqrt, correctly rounded in eager mode too: eager's CPU sqrt is not (about 1 value in
  5 an ulp off) where compiled kernels' is. Through fp64 then rounded to fp32 it is exact (a
  sqrt of an fp32 value never falls near enough to an fp32 rounding boundary for fp64's error
  to matter), so eager -- the fallback where compiling fails -- keeps the compiled bits."""
  if torch.compiler.is_compiling():
    return x.sqrt()
  return x.double().sqrt().float()


def _adam(p, grad, scale, m, v, scalars, l2):
  """torch's single-tensor Adam(W) step in fp32, op for op: (param, exp_avg, exp_avg_sq) after it.
  grad (bf16 or fp32) times the fp32 `scale` (the clip coefficient: the multiply clipping does
  in place, so the same bits). scalars: fp32 [param decay, 1 - beta1, beta2, 1 - beta2,
  sqrt(bias correction 2), eps, -step size, L2 weight decay (Adam)]."""
  grad = grad.float() * scale
  if l2:                                        # Adam: grad.add(param, alpha=weight_decay)
    grad = grad + scalars[7] * p
  p = p * scalars[0]                            # AdamW: param.mul_(1 - lr * weight_decay)
  m = m + scalars[1] * (grad - m)               # exp_avg.lerp_(grad, 1 - beta1)
  v = v * scalars[2]
  v = v + scalars[3] * grad * grad              # .addcmul_(grad, grad, value=1 - beta2)
  denom = _sqrt(v) / scalars[4] + scalars[5]
  return p + scalars[6] * m / denom, m, v       # param.addcdiv_(exp_avg, denom, value=-step_size)


def _adamw_kernel(param, grad, scale, exp_avg, exp_avg_sq, scalars, layout, seeds, l2):
  """In place: _adam on bf16 param/moments widened to fp32, each result rounded back with its
  own seed."""
  p, m, v = _adam(param.float(), grad, scale, exp_avg.float(), exp_avg_sq.float(), scalars, l2)
  index = stochastic_rounding.index_from_layout(param.shape, layout)
  param.copy_(_round(p, index, seeds[0]))
  exp_avg.copy_(_round(m, index, seeds[1]))
  exp_avg_sq.copy_(_round(v, index, seeds[2]))


def _adamw_fp32_kernel(param, grad, scale, exp_avg, exp_avg_sq, scalars, l2):
  """In place: _adam on fp32 param (an fp32 recipe's parameter, or a master) and moments."""
  p, m, v = _adam(param, grad, scale, exp_avg, exp_avg_sq, scalars, l2)
  param.copy_(p)
  exp_avg.copy_(m)
  exp_avg_sq.copy_(v)


def _adamw_master_kernel(param, grad, scale, exp_avg, exp_avg_sq, scalars, l2, narrow):
  """_adamw_fp32_kernel on an fp32 master that also writes the stepped rows, rounded to nearest
  as copy_ rounds them, into `narrow` (the 16-bit parameter's rows): mixed_precision's copy back
  in the same pass (inductor fuses the copy into the update's loop), not one more over the
  master (12 ms of a 32M model's 1.3 s step)."""
  _adamw_fp32_kernel(param, grad, scale, exp_avg, exp_avg_sq, scalars, l2)
  narrow.copy_(param)
