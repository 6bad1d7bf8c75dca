"""Activation recompute (NxD Training's model.activations_checkpoint_granularity).

  None       every layer keeps all it needs for backward.
  selective  recompute in backward the parts model.activations_checkpoint_recompute names:
             'attention' (core attention, softmax(q k^T) v), 'mlp' (the whole MLP), 'norm'
             (the block's two norms: NxD's LlamaRMSNorm) and 'activation' (act(gate) * up:
             NxD's ActivationMultiplyMLP).
  full       keep only each layer's input; recompute the whole block in backward.

All go through torch.utils.checkpoint (non-reentrant). Dropout masks are keyed by sample
index, so the recomputed forward draws exactly the masks of the first one and gradients are
bitwise those of no recompute. What each mode keeps per layer: estimates/memory.py.
"""
import dataclasses
from typing import Callable

import torch
import torch.utils.checkpoint

from config_checks import one_of
from model import layers
from parallel import xla

PARTS = ('attention', 'mlp', 'norm', 'activation')
GRANULARITIES = (None, 'selective', 'full')


def checkpointed(fn, *args):
  # Dropout draws from keyed generators, never the global RNG: no RNG state to stash.
  if any(torch.is_tensor(a) and a.device.type == 'xla' for a in args):
    return xla.checkpoint(fn, *args)        # torch.utils.checkpoint fails under torch-xla
  return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


@dataclasses.dataclass(frozen=True)
class Recompute:
  """What to recompute, as wrappers wrap(fn, *args) around a block, its core attention, its
  MLP, its norms and its gated activation. The value is the model's `layer_fn` (called once per block); `hooks(ops)` puts
  the attention and MLP wrappers into the Ops the model is built from."""
  block: Callable = layers.no_recompute
  attention: Callable = layers.no_recompute
  mlp: Callable = layers.no_recompute
  norm: Callable = layers.no_recompute
  activation: Callable = layers.no_recompute

  def __call__(self, fn, *args):
    return self.block(fn, *args)

  def hooks(self, ops):
    return dataclasses.replace(ops, recompute_attention=self.attention, recompute_mlp=self.mlp,
                               recompute_norm=self.norm, recompute_activation=self.activation)


def setup(ops, granularity, recompute=('attention',)):
  """(ops with the recompute hooks, the model's layer_fn) for a granularity (see policy)."""
  chosen = policy(granularity, recompute)
  return (ops, None) if chosen is None else (chosen.hooks(ops), chosen)


def policy(granularity, recompute=('attention',)):
  """The `layer_fn` for model.transformer.stage: a Recompute, or None (nothing to wrap, so
  the default path costs nothing extra). `recompute` is used by 'selective' only."""
  if granularity in (None, ''):
    return None
  if granularity == 'full':
    return Recompute(block=checkpointed)
  if granularity == 'selective':
    unknown = set(recompute) - set(PARTS)
    if unknown:
      raise ValueError(f'activations_checkpoint_recompute: unknown parts {sorted(unknown)}; '
                       f'valid: {PARTS}')
    pick = lambda part: checkpointed if part in recompute else layers.no_recompute
    return Recompute(**{part: pick(part) for part in PARTS})
  raise ValueError(f'activations_checkpoint_granularity={granularity!r}; valid: None, selective, full')


def check(model_cfg) -> list:
  """Problems with model.activations_checkpoint_granularity / _recompute, before `policy` meets them."""
  problems = []
  one_of(problems, 'model.activations_checkpoint_granularity', model_cfg.activations_checkpoint_granularity,
         GRANULARITIES)
  for part in model_cfg.activations_checkpoint_recompute:
    one_of(problems, 'model.activations_checkpoint_recompute', part, PARTS)
  return problems
