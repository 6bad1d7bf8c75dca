"""Precision recipes (NxD Training names) and stochastic rounding fp32 -> bf16.

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

SR adds uniform 16-bit noise to the low half of the fp32 bit pattern and truncates it:
the result is one of the two bf16 values bracketing x, the upper with probability
(x - down) / (up - down). The noise comes from rng.py, keyed like every other draw,
so a step is reproduced bit for bit on any device and after a resume. stochastic_round_at
hashes (key, global element index) with a 32-bit counter hash (noise_at) instead of drawing
per shape, so every parallel layout rounds every element the same way. optim/sr_update.py
runs the same functions compiled, fused with bf16SR's Adam(W) step.
"""
import contextlib
import dataclasses
from typing import Union

import torch

import rng

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
# never pays the compile.
FUSED_FP32_DEVICES = ('cpu',)
FUSED_FP32_MIN_NUMEL = 1 << 16

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

  The same key rounds the same way bit for bit, but the noise is drawn for x's own shape:
  a shard (ZeRO-1, TP) rounds differently from the same elements of the whole tensor.
  stochastic_round_at rounds every element the same way under any layout.
  """
  return stochastic_round(x, rng.generator(*key))


_HASH_MUL_1 = 0x7FEB352D                  # lowbias32 (C. Wellons' integer hash prospector)
_HASH_MUL_2 = 0x846CA68B - (1 << 32)      # its second multiplier, as the int32 with its bits
_GOLDEN_32 = 0x9E3779B9 - (1 << 32)       # folds the index's high word in


def _shift_right(z, bits):
  """Logical z >> bits on int32: torch shifts arithmetically, so clear the copied sign bits."""
  return (z >> bits) & ((1 << (32 - bits)) - 1)


def key_seed(*key) -> int:
  """The 32-bit hash key of `key` (rng.key_to_seed folded), as an int32 value."""
  seed = rng.key_to_seed(*key)
  seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
  return seed - (1 << 32) if seed >= 1 << 31 else seed


def noise_at(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
  """int32 noise in [0, 2^16) for int64 global element indices under an int32 `seed` tensor.

  A stateless counter hash, so element i's noise needs neither a generator nor its neighbours:
  the top 16 bits of lowbias32(low word of i ^ seed ^ high word * golden ratio). Every op is
  int32 with wrapping multiplies (torch on CPU/CUDA, XLA), so eager, compiled and every device
  agree bit for bit, and 32-bit lanes vectorize twice as wide as the int64 splitmix64 it
  replaced. The seed is a tensor: on XLA a changing Python scalar would be a new graph per step.
  """
  if index.dtype == torch.int32:     # indices below 2^31 (index_from_layout's int32 grid): no high word
    x = index ^ seed
  else:
    x = index.to(torch.int32) ^ seed ^ ((index >> 32).to(torch.int32) * _GOLDEN_32)
  x = x ^ _shift_right(x, 16)
  x = x * _HASH_MUL_1
  x = x ^ _shift_right(x, 15)
  x = x * _HASH_MUL_2
  # lowbias32 ends with x ^= x >> 16, which leaves the top half -- all we keep -- as it is.
  return _shift_right(x, 16)


def _check_box(box, global_shape):
  if len(box) != len(global_shape) or not all(isinstance(s, slice) for s in box):
    raise ValueError(f'box must be one slice per dim of {tuple(global_shape)}, got {box!r}')


def _flat_index(box, global_shape, device):
  """int64 row-major index into global_shape of each element of `box`, in the box's shape."""
  _check_box(box, global_shape)
  index = torch.zeros((), dtype=torch.int64, device=device)
  stride = 1
  for dim in reversed(range(len(global_shape))):
    coords = torch.arange(*box[dim].indices(global_shape[dim]), dtype=torch.int64, device=device)
    # Broadcasting builds the box dim by dim from the last, without materialising a grid.
    index = index + (coords * stride).view((-1,) + (1,) * (len(global_shape) - 1 - dim))
    stride *= global_shape[dim]
  return index


def index_layout(box, global_shape):
  """(sizes, [offset, *strides]): the box's global indices as offset + sum_d i_d * stride_d over
  a grid of `sizes` (the box in row-major order, dims coalesced where the box spans a whole dim:
  ZeRO-1 row shards and whole tensors are one run, TP column blocks two dims)."""
  _check_box(box, global_shape)
  sizes, strides, offset, stride = [], [], 0, 1
  for dim in reversed(range(len(global_shape))):
    start, stop, step = box[dim].indices(global_shape[dim])
    if step != 1:
      raise ValueError(f'box must be contiguous slices of {tuple(global_shape)}, got {box!r}')
    length = max(stop - start, 0)
    offset += start * stride
    if sizes and sizes[0] * strides[0] == stride:    # the dims after this one are whole
      sizes[0] *= length
    else:
      sizes.insert(0, length)
      strides.insert(0, stride)
    stride *= global_shape[dim]
  return sizes or [1], [offset] + (strides or [1])


def index_from_layout(sizes, layout: torch.Tensor) -> torch.Tensor:
  """Global indices over a grid of `sizes`, from index_layout's list as a tensor (traceable:
  under torch.compile the aranges fuse into the kernel's loop indices), in the layout's dtype:
  int64, or int32 where every index of the global tensor is below 2^31 (layout_dtype), which
  halves the integer lanes and gives noise_at the same bits."""
  index = layout[0]
  for dim, size in enumerate(sizes):
    coords = torch.arange(size, dtype=layout.dtype, device=layout.device) * layout[dim + 1]
    index = index + coords.view((-1,) + (1,) * (len(sizes) - 1 - dim))
  return index


def layout_dtype(global_shape) -> torch.dtype:
  """The index dtype for a tensor of global_shape: int32 while its indices fit (< 2^31)."""
  numel = 1
  for n in global_shape:
    numel *= n
  return torch.int32 if numel <= 2**31 else torch.int64


def keyed_noise(box, global_shape, *key, device='cpu') -> torch.Tensor:
  """int32 noise in [0, 2^16) for the `box` (one slice per dim) of a tensor of global_shape.

  Element i (global row-major index) gets noise_at(i, key_seed(key)): a pure function of
  (key, i), so any box -- a ZeRO-1 row shard, a TP column block, the whole tensor -- sees the
  same noise for the same element, on any device.
  """
  index = _flat_index(box, global_shape, torch.device(device))
  return noise_at(index, torch.tensor(key_seed(*key), dtype=torch.int32, device=device))


def stochastic_round_at(x: torch.Tensor, box, global_shape, *key) -> torch.Tensor:
  """stochastic_round of x, the `box` of a tensor of global_shape, with keyed_noise.

  Every parallel layout rounds every element identically, so bf16SR runs agree bit for bit
  across ZeRO-1 and TP splits, e.g. key (seed, 'sr', step, name).
  """
  return stochastic_round(x, keyed_noise(box, global_shape, *key, device=x.device))


def stochastic_round_many(items) -> list:
  """[stochastic_round_at(x, box, global_shape, *key) for (x, box, global_shape, key) in items],
  bit for bit, with one rounding over all of them: on XLA the int32 views of the bits run as a
  CPU fallback that cuts the graph, so one call per bucket compiles far fewer graphs than one
  per tensor. (Eager CPU/CUDA round per tensor, compiled: optim/sr_update.py.)"""
  if not items:
    return []
  flat = torch.cat([x.reshape(-1).float() for x, _, _, _ in items])
  noise = torch.cat([keyed_noise(box, shape, *key, device=x.device).reshape(-1) for x, box, shape, key in items])
  rounded, out, offset = stochastic_round(flat, noise), [], 0
  for x, _, _, _ in items:
    out.append(rounded[offset:offset + x.numel()].view(x.shape))
    offset += x.numel()
  return out


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
