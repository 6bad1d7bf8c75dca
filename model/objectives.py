"""Training objectives: what the last pipeline stage computes from the logits.

An objective is two plain functions of a micro batch:
  count(batch)                       the normaliser it adds to the global batch's (tokens, or
                                     pairs), known before the forward pass so every micro
                                     batch's loss can be divided by the global total at once
  loss(logits, batch, cfg, ops)  ->  (loss sum, {metric name: sum})
Sums, not means: the loop divides by the global count, so every layout and micro-batch split
computes the same number. `model.objective` picks one by name.
"""
import typing


class Objective(typing.NamedTuple):
  count: typing.Callable
  loss: typing.Callable


def _loss_mask_count(batch):
  return batch['loss_mask'].sum()


def _next_token_loss(logits_bsv, batch, cfg, ops):
  """Cross-entropy of each next token where loss_mask is 1 (pretraining; SFT masks prompts)."""
  per_token = ops.cross_entropy(logits_bsv, batch['labels'], cfg.vocab_size)
  return (per_token * batch['loss_mask']).sum(), {}


NEXT_TOKEN = Objective(_loss_mask_count, _next_token_loss)
OBJECTIVES = {'next_token': NEXT_TOKEN}


def get(name) -> Objective:
  if name not in OBJECTIVES:
    raise ValueError(f'model.objective={name!r} is unknown; valid: {", ".join(OBJECTIVES)}')
  return OBJECTIVES[name]
