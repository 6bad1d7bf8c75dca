"""Precision recipes (NxD Training names) and stochastic rounding fp32 -> bf16.

`precision.type` picks one row; `manual` builds a row from the knobs below it.

| type              | params | compute  | master   | grad acc | reduce | param rounding to bf16
|-------------------|--------|----------|----------|----------|--------|----------------------------
| fp32              | fp32   | fp32     | -        | fp32     | fp32   | -
| bf16SR            | bf16   | bf16     | -        | bf16     | bf16   | stochastic, param + update
| mixed_precision   | bf16   | bf16     | fp32 (1) | fp32     | fp32   | nearest, master -> param
| mixed_precisionSR | bf16   | bf16     | fp32 (1) | fp32     | fp32   | stochastic, master -> param
| autocast          | fp32   | bf16 (2) | -        | fp32     | fp32   | -
| manual            | P (3)  | P        | (4)      | (5)      | = acc  | (6)

(1) held by the optimizer, sharded over data parallel under ZeRO-1. (2) under
torch.autocast(bf16): matmuls in bf16, params and grads stay fp32. (3) P =
parameter_dtype. (4) fp32 if master_weights. (5) fp32 if fp32_grad_acc, else P.
(6) stochastic if stochastic_rounding, else nearest.

Where parameters are bf16, an update is rounded to bf16 once per step: without master
weights at `param.float() + update`, with master weights at the copy master -> param.
Round-to-nearest there loses every update smaller than half a bf16 ulp (2^-8 at 1.0), so
long runs stall; stochastic rounding (SR) keeps each update in expectation.

SR adds uniform 16-bit noise to the low half of the fp32 bit pattern and truncates it:
the result is one of the two bf16 values bracketing x, the upper with probability
(x - down) / (up - down). The noise comes from model.rng, keyed like every other draw,
so a step is reproduced bit for bit on any device and after a resume.
"""
import contextlib
import dataclasses
from typing import Union

import torch

from model import rng

TYPES = ('fp32', 'bf16SR', 'mixed_precision', 'mixed_precisionSR', 'autocast', 'manual')
PARAMETER_DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
# The knobs `manual` reads, with the defaults of configs/base.py; other types ignore them.
MANUAL_KNOBS = {'master_weights': False, 'fp32_grad_acc': False, 'parameter_dtype': 'fp32',
                'stochastic_rounding': False}

_LOW_HALF = 1 << 16                  # fp32 bits that bf16 drops
_HIGH_HALF_MASK = -_LOW_HALF         # 0xFFFF0000 as an int32
_BF16_MAX = torch.finfo(torch.bfloat16).max


# --- stochastic rounding

def stochastic_round(x: torch.Tensor, generator_or_noise: Union[torch.Generator, torch.Tensor]):
  """x rounded to bf16 stochastically: unbiased, always a bf16 neighbour of x.

  `generator_or_noise` is a CPU torch.Generator (noise is drawn on the CPU and moved, so
  every device type rounds the same way) or integer noise in [0, 2^16) of x's shape.

  fp32 is sign-magnitude, so adding noise to the bit pattern grows the magnitude for
  either sign: truncation rounds toward zero, a carry into bit 16 rounds away from zero,
  with probability (|x| - |down|) / ulp -- unbiased for negatives too. Subnormals are
  evenly spaced bit patterns, so the same holds (on devices that keep subnormals).
  inf and nan pass through. A finite x beyond bf16 max (up to fp32 max) saturates to
  +-bf16 max, its round-toward-zero neighbour: SR never turns a finite value into inf.
  """
  x = x.to(torch.float32)
  if isinstance(generator_or_noise, torch.Generator):
    noise = torch.randint(0, _LOW_HALF, x.shape, generator=generator_or_noise, dtype=torch.int32)
  else:
    noise = generator_or_noise
    if noise.shape != x.shape or noise.dtype.is_floating_point:
      raise ValueError(f'noise must be integers of shape {tuple(x.shape)}, '
                       f'got {noise.dtype} of shape {tuple(noise.shape)}')
  noise = noise.to(device=x.device, dtype=torch.int32)
  # Finite fp32 bits are at most 0x7F7FFFFF in magnitude, so the sum never leaves int32.
  bits = (x.view(torch.int32) + noise) & _HIGH_HALF_MASK
  rounded = bits.view(torch.float32).clamp(-_BF16_MAX, _BF16_MAX)
  # The low half is zero, so this cast is exact; nan/inf take the untouched x.
  return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def stochastic_round_keyed(x: torch.Tensor, *key) -> torch.Tensor:
  """stochastic_round with noise from rng.generator(*key), e.g. key (seed, 'sr', step, name).

  The same key rounds the same way bit for bit. A sharded tensor (ZeRO-1, TP) rounding
  only its shard should put the shard's identity in the key (or draw the full shape and
  slice), or different layouts round differently.
  """
  return stochastic_round(x, rng.generator(*key))


def add_stochastic(param: torch.Tensor, update: torch.Tensor, *key) -> torch.Tensor:
  """bf16 of param + update, summed in fp32 and rounded stochastically (bf16SR updates)."""
  return stochastic_round_keyed(param.float() + update.float(), *key)


# --- recipes

@dataclasses.dataclass(frozen=True)
class Recipe:
  """How one run stores, computes, accumulates and reduces (see the table above)."""
  name: str
  param_dtype: torch.dtype           # dtype of the model's parameters
  compute_dtype: torch.dtype         # dtype matmuls run in
  master_weights: bool               # the optimizer keeps an fp32 copy of bf16 params
  grad_acc_dtype: torch.dtype        # dtype gradients accumulate in over microbatches
  reduce_dtype: torch.dtype          # dtype of the data-parallel gradient reduction
  stochastic_rounding: bool          # fp32 -> bf16 parameter rounding is stochastic
  autocast: bool                     # forward runs under torch.autocast(compute_dtype)


_F32, _BF16 = torch.float32, torch.bfloat16
_RECIPES = {
    'fp32': Recipe('fp32', _F32, _F32, False, _F32, _F32, False, False),
    'bf16SR': Recipe('bf16SR', _BF16, _BF16, False, _BF16, _BF16, True, False),
    'mixed_precision': Recipe('mixed_precision', _BF16, _BF16, True, _F32, _F32, False, False),
    'mixed_precisionSR': Recipe('mixed_precisionSR', _BF16, _BF16, True, _F32, _F32, True, False),
    'autocast': Recipe('autocast', _F32, _BF16, False, _F32, _F32, False, True),
}


def _knob(cfg, name):
  return getattr(cfg, name, MANUAL_KNOBS[name])


def check(cfg) -> list:
  """Every problem in the `precision` config section, each naming its key and the fix."""
  p = []
  kind = getattr(cfg, 'type', None)
  if kind not in TYPES:
    return [f'precision.type={kind!r} is unknown; valid: {", ".join(TYPES)}']
  if kind != 'manual':
    # A knob set under another type would be silently ignored; the user meant something.
    for name, default in MANUAL_KNOBS.items():
      if _knob(cfg, name) != default:
        p.append(f'precision.{name}={_knob(cfg, name)!r} is read only with precision.type='
                 f"'manual' (type is {kind!r}); reset it to {default!r} or use type='manual'")
    return p
  dtype = _knob(cfg, 'parameter_dtype')
  if dtype not in PARAMETER_DTYPES:
    p.append(f'precision.parameter_dtype={dtype!r} is unknown; '
             f'valid: {", ".join(PARAMETER_DTYPES)}')
  elif dtype == 'fp32':
    if _knob(cfg, 'master_weights'):
      p.append("precision.master_weights=True with parameter_dtype='fp32': the params already "
               "are fp32, a master copy only doubles their memory; set master_weights=False or "
               "parameter_dtype='bf16'")
    if _knob(cfg, 'stochastic_rounding'):
      p.append("precision.stochastic_rounding=True with parameter_dtype='fp32': nothing is "
               "rounded to bf16; set stochastic_rounding=False or parameter_dtype='bf16'")
  return p


def recipe(cfg) -> Recipe:
  """The Recipe for a `precision` config section; ValueError listing every problem."""
  problems = check(cfg)
  if problems:
    raise ValueError('invalid precision config:\n  - ' + '\n  - '.join(problems))
  if cfg.type != 'manual':
    return _RECIPES[cfg.type]
  params = PARAMETER_DTYPES[_knob(cfg, 'parameter_dtype')]
  grads = _F32 if _knob(cfg, 'fp32_grad_acc') else params
  return Recipe('manual', params, params, bool(_knob(cfg, 'master_weights')), grads, grads,
                bool(_knob(cfg, 'stochastic_rounding')), False)


def compute_context(r: Recipe, device_type: str):
  """The context the forward runs in: torch.autocast for `autocast`, else a no-op."""
  if not r.autocast:
    return contextlib.nullcontext()
  return torch.autocast(device_type=device_type, dtype=r.compute_dtype)
