"""Keyed randomness: every random draw comes from a generator seeded by its purpose.

A key is a tuple such as (seed, 'init', 'layers.3.mlp.up_proj.weight') or
(seed, 'dropout', sample_index, layer, 'attn'). The same key gives the same numbers on
any device count or parallel layout, and resuming needs no saved RNG state.
"""
import hashlib

import torch


def key_to_seed(*key) -> int:
  """A 63-bit integer that is a pure function of the key's printed parts."""
  digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
  return int.from_bytes(digest, 'little') & ((1 << 63) - 1)


def generator(*key, device='cpu') -> torch.Generator:
  return torch.Generator(device=device).manual_seed(key_to_seed(*key))


def normal(shape, std, *key, dtype=torch.float32) -> torch.Tensor:
  """N(0, std^2) drawn on the CPU (so every device type draws the same numbers)."""
  return torch.randn(shape, generator=generator(*key), dtype=dtype) * std


def uniform(shape, *key) -> torch.Tensor:
  return torch.rand(shape, generator=generator(*key))
