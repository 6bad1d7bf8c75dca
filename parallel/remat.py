"""Activation recompute: a wrapper around each transformer block call.

`full` keeps only each layer's input and recomputes the block in backward
(torch.utils.checkpoint, non-reentrant). Dropout masks are keyed by sample index, so the
recomputed forward draws exactly the masks of the first one.
"""
import torch.utils.checkpoint


def _checkpointed(fn, *args):
  return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def layer_fn(granularity):
  """The `layer_fn` for model.transformer.forward, or None for no recompute."""
  if granularity == 'full':
    return _checkpointed
  if granularity in (None, ''):
    return None
  raise ValueError(f'activations_checkpoint_granularity={granularity!r} is not implemented here')
