"""Stochastic rounding fp32 -> bf16 (the rounding of numerics/precision.py's SR recipes).

SR adds uniform 16-bit noise to the low half of the fp32 bit pattern and truncates it:
the result is one of the two bf16 values bracketing x, the upper with probability
(x - down) / (up - down). The noise comes from rng.py, keyed like every other draw,
so a step is reproduced bit for bit on any device and after a resume. stochastic_round_at
hashes (key, global element index) with a 32-bit counter hash (noise_at) instead of drawing
per shape, so every parallel layout rounds every element the same way. optim/sr_update.py
runs the same functions compiled, fused with bf16SR's Adam(W) step.
"""
from typing import Union

import torch

import rng

_LOW_HALF = 1 << 16                  # fp32 bits that bf16 drops
_HIGH_HALF_MASK = -_LOW_HALF         # 0xFFFF0000 as an int32
_BF16_MAX = torch.finfo(torch.bfloat16).max


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
