"""Precision recipes (NxD Training names): how a run stores, computes, accumulates, reduces and rounds.

`precision.type` picks one row; `manual` builds a row from the knobs below it.

| type              | params | compute  | master   | grad acc | reduce | param rounding to bf16
|-------------------|--------|----------|----------|----------|--------|----------------------------
| fp32              | fp32   | fp32     | -        | fp32     | fp32   | -
| bf16SR            | bf16   | bf16     | - (7)    | bf16     | bf16   | stochastic, param + update
| mixed_precision   | bf16   | bf16     | fp32 (1) | fp32     | fp32   | nearest, master -> param
| mixed_precisionSR | bf16   | bf16     | fp32 (1) | fp32     | fp32   | stochastic, master -> param
| autocast          | fp32   | bf16 (2) | -        | fp32     | fp32   | -
| manual            | P (3)  | P        | (4)      | (5)      | = acc  | (6)

(1) held by the optimizer, sharded over data parallel under ZeRO-1. (2) under
torch.autocast(bf16): matmuls in bf16, params and grads stay fp32. (3) P =
parameter_dtype. (4) fp32 if master_weights. (5) fp32 if fp32_grad_acc, else P.
(6) stochastic if stochastic_rounding, else nearest. (7) the optimizer's moments are bf16
too (NxD's bf16SR): widened to fp32 for the update, rounded back (stochastically) after it.
Without master weights the state is kept in the parameter's dtype.

Where parameters are bf16, an update is rounded to bf16 once per step: without master
weights at `param.float() + update`, with master weights at the copy master -> param.
Round-to-nearest there loses every update smaller than half a bf16 ulp (2^-8 at 1.0), so
long runs stall; stochastic rounding (SR) keeps each update in expectation.

SR itself (keyed, layout-invariant noise) is numerics/stochastic_rounding.py.
"""
import contextlib
import dataclasses

import torch

from numerics import fp8

TYPES = ('fp32', 'bf16SR', 'mixed_precision', 'mixed_precisionSR', 'autocast', 'manual')
PARAMETER_DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
# The knobs `manual` reads, with the defaults of configs/base.py; other types ignore them.
MANUAL_KNOBS = {'master_weights': False, 'fp32_grad_acc': False, 'parameter_dtype': 'fp32',
                'stochastic_rounding': False}

# Device types optim/sr_update.py compiles bf16SR's one-pass update for (the memory estimate reads it;
# on CUDA only once a probe showed the compiled kernels reproduce eager's bits).
FUSED_SR_DEVICES = ('cpu', 'cuda')
# ... and Adam(W) on fp32 rows (fp32 parameters, masters): on the CPU, where torch steps one
# tensor at a time, an op per pass (CUDA's fused AdamW is one multi-tensor kernel already); for
# parameters of at least FUSED_FP32_MIN_NUMEL elements (globally, so every layout decides
# alike): below, torch's step costs less than a compiled call, and a small model's process
# never pays the compile. The clip norm compiles on the same threshold (per local tensor,
# optim/sr_update.square_sum): below it an eager norm costs less than a compiled call.
FUSED_FP32_DEVICES = ('cpu',)
FUSED_FP32_MIN_NUMEL = 1 << 16


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

  def state_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype optimizer state (moments) is stored in for a parameter of `param_dtype`:
    fp32 with master weights, else the parameter's own (bf16SR: bf16 moments, as NxD keeps them)."""
    return torch.float32 if self.master_weights else param_dtype

  def has_master(self, param_dtype: torch.dtype) -> bool:
    """Whether a parameter of `param_dtype` gets a separate fp32 master copy."""
    return self.master_weights and param_dtype != torch.float32


_F32, _BF16 = torch.float32, torch.bfloat16
_RECIPES = {
    'fp32': Recipe(
        name='fp32', param_dtype=_F32, compute_dtype=_F32, master_weights=False,
        grad_acc_dtype=_F32, reduce_dtype=_F32, stochastic_rounding=False, autocast=False),
    'bf16SR': Recipe(
        name='bf16SR', param_dtype=_BF16, compute_dtype=_BF16, master_weights=False,
        grad_acc_dtype=_BF16, reduce_dtype=_BF16, stochastic_rounding=True, autocast=False),
    'mixed_precision': Recipe(
        name='mixed_precision', param_dtype=_BF16, compute_dtype=_BF16, master_weights=True,
        grad_acc_dtype=_F32, reduce_dtype=_F32, stochastic_rounding=False, autocast=False),
    'mixed_precisionSR': Recipe(
        name='mixed_precisionSR', param_dtype=_BF16, compute_dtype=_BF16, master_weights=True,
        grad_acc_dtype=_F32, reduce_dtype=_F32, stochastic_rounding=True, autocast=False),
    'autocast': Recipe(
        name='autocast', param_dtype=_F32, compute_dtype=_BF16, master_weights=False,
        grad_acc_dtype=_F32, reduce_dtype=_F32, stochastic_rounding=False, autocast=True),
}


def _knob(cfg, name):
  return getattr(cfg, name, MANUAL_KNOBS[name])


def check(cfg) -> list:
  """Every problem in the `precision` config section, each naming its key and the fix."""
  p = []
  kind = getattr(cfg, 'type', None)
  if getattr(cfg, 'parallel_layers_reduce_dtype', None) not in (None, *REDUCE_DTYPES):
    p.append(f'precision.parallel_layers_reduce_dtype={cfg.parallel_layers_reduce_dtype!r} is unknown; '
             f'valid: None (the activations\' dtype), {", ".join(REDUCE_DTYPES)}')
  if kind not in TYPES:
    return p + [f'precision.type={kind!r} is unknown; valid: {", ".join(TYPES)}']
  p += _check_fp8(cfg)
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


def _check_fp8(cfg) -> list:
  name = getattr(cfg, 'fp8', None)
  if name is None:
    return []
  if name not in fp8.RECIPES:
    return [f'precision.fp8={name!r} is unknown; valid: {", ".join(fp8.RECIPES)}, or None (off)']
  params = PARAMETER_DTYPES.get(_knob(cfg, 'parameter_dtype'))
  if cfg.type == 'fp32' or (cfg.type == 'manual' and params == torch.float32):
    return [f'precision.fp8={name!r} needs 16-bit compute, and precision.type={cfg.type!r} computes in fp32: '
            'use bf16SR, mixed_precision(SR) or autocast, or unset precision.fp8']
  return []


def recipe(cfg) -> Recipe:
  """The Recipe for a `precision` config section; ValueError listing every problem."""
  problems = check(cfg)
  if problems:
    raise ValueError('invalid precision config:\n  - ' + '\n  - '.join(problems))
  if cfg.type != 'manual':
    return _RECIPES[cfg.type]
  params = PARAMETER_DTYPES[_knob(cfg, 'parameter_dtype')]
  grads = _F32 if _knob(cfg, 'fp32_grad_acc') else params
  return Recipe(name='manual', param_dtype=params, compute_dtype=params,
                master_weights=bool(_knob(cfg, 'master_weights')), grad_acc_dtype=grads,
                reduce_dtype=grads, stochastic_rounding=bool(_knob(cfg, 'stochastic_rounding')),
                autocast=False)


REDUCE_DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


def parallel_layers_reduce_dtype(cfg):
  """The dtype of the tensor-parallel layers' reductions (row-parallel outputs, column-parallel
  input gradients), NxD's precision.parallel_layers_reduce_dtype for every type; None: the
  activations' own dtype (NxD's default: bf16 in the 16-bit recipes, fp32 in fp32)."""
  name = getattr(cfg, 'parallel_layers_reduce_dtype', None)      # its values: `check`
  return None if name is None else REDUCE_DTYPES[name]


def compute_context(r: Recipe, device_type: str):
  """The context the forward runs in: torch.autocast for `autocast`, else a no-op."""
  if not r.autocast:
    return contextlib.nullcontext()
  return torch.autocast(device_type=device_type, dtype=r.compute_dtype)
