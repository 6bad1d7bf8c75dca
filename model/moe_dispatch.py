"""How a MoE layer's kept (token, expert) slots reach their experts and come back
(model/moe.py routes them): eagerly sorted by expert, each expert one matmul over exactly its
tokens; traced (model.compile, XLA) in fixed-size buffers, one row per slot. And the capacity
both keep to: C = ceil(capacity_factor * s * top_k / E) tokens per expert per sequence.
"""
import math

import torch
import torch.nn.functional as F

import host_values
from model import moe_kernels


def capacity(cfg, tokens) -> int:
  """Tokens each expert keeps per sequence of `tokens` tokens (dropless: all of them)."""
  moe = cfg.moe
  if moe.dropless:
    return tokens
  return min(tokens, math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.num_experts))


def fixed_buffers(cfg, x) -> bool:
  """Whether the experts run in fixed-size buffers: inside a traced graph (model.compile, or
  torch-xla, which compiles the whole step), where a data-dependent size would be a graph per
  batch, or with model.moe.fixed_buffers; eager runs otherwise sort the tokens and compute only
  the kept ones."""
  return bool(cfg.moe.get('fixed_buffers')) or x.device.type == 'xla' or torch.compiler.is_compiling()


def sorted_experts(flat_x, experts, weights, kept, cfg, stacks, ops):
  """Eager: the kept (token, expert) slots sorted by expert, each expert one matmul triple on
  exactly its tokens (the counts go to the host), weighted back onto their tokens."""
  n = flat_x.shape[0]
  if host_values.is_fake(kept):     # a traced step: how many slots are kept, and where, is the routing's
    host_values.note('MoE: every (token, expert) slot kept, the tokens spread evenly over the experts')
    slot = torch.arange(kept.numel(), device=kept.device)
  else:
    slot = kept.reshape(-1).nonzero().squeeze(-1)        # kept slots (token t's j-th: t k + j)
  expert = experts.reshape(-1)[slot]
  slot = slot[torch.sort(expert, stable=True).indices]    # ... sorted by expert
  counts = host_values.read(expert, lambda e: torch.bincount(e, minlength=cfg.moe.num_experts).tolist(),
                            'MoE: the tokens per expert (spread evenly)',
                            lambda: host_values.balanced(slot.shape[0], cfg.moe.num_experts))
  token = slot // cfg.moe.top_k
  weight = ops.copy_to_tp(weights.reshape(-1).index_select(0, slot))   # scales partial outputs: gradient partial
  x = flat_x.index_select(0, token)
  if cfg.moe.get('scale_expert_input'):      # Llama 4: the weight scales the expert's input, not its output
    x, weight = (x * weight[:, None]).to(x.dtype), torch.ones_like(weight)
  out = (ops.expert_ffn or moe_kernels.local_expert_ffn)(x, counts, stacks, ops.fp8_gemms)
  return _Combine.apply(out, weight, token, n)


def buffer_rows(cfg, b, s) -> int:
  """Rows of each expert's fixed-size buffer: b C with capacity (each sequence keeps at most C
  tokens per expert), b s dropless (a static upper bound: every token could pick one expert,
  so E / top_k times the kept slots' compute)."""
  return b * s if cfg.moe.dropless else b * capacity(cfg, s)


def static_experts(flat_x, experts_bsk, weights_bsk, cfg, stacks, ops):
  """Traced: every (token, expert) slot gets a row of its expert's buffer [E, R, h], the
  experts run as batched matmuls over the buffers (Ops.expert_buffers: exchanged over EP), and
  each slot's row comes back weighted (weight 0: dropped). No host sync, no data-dependent
  shape; the rows a slot takes are the eager path's queue positions, so the same tokens drop."""
  e = cfg.moe.num_experts
  b, s, k = experts_bsk.shape
  rows = buffer_rows(cfg, b, s)
  onehot = F.one_hot(experts_bsk.reshape(b, s * k), e)              # [b, s k, E]
  if cfg.moe.dropless:       # the slot's place in its expert's queue over the micro batch
    place = (onehot.reshape(b * s * k, e).cumsum(0) * onehot.reshape(b * s * k, e)).sum(-1) - 1
  else:                      # in its sequence's queue, after the earlier sequences' C rows each
    queue = (onehot.cumsum(1) * onehot).sum(-1) - 1                  # [b, s k]
    cap = rows // b
    place = torch.where(queue < cap, queue + cap * torch.arange(b, device=queue.device)[:, None], rows)
    place = place.reshape(-1)
  expert = experts_bsk.reshape(-1)
  dest = torch.where(place < rows, expert * rows + place, e * rows)  # e * rows: a spare row for the dropped
  h = flat_x.shape[1]
  slots_x = flat_x[:, None, :].expand(b * s, k, h).reshape(b * s * k, h)
  if cfg.moe.get('scale_expert_input'):      # Llama 4: the weight scales the expert's input; the output is kept or dropped
    slots_x = (slots_x * weights_bsk.reshape(-1, 1)).to(slots_x.dtype)
    weights_bsk = (weights_bsk != 0).to(weights_bsk.dtype)
  buffers = flat_x.new_zeros(e * rows + 1, h).index_copy(0, dest, slots_x)[:-1].view(e, rows, h)
  out = (ops.expert_buffers or moe_kernels.grouped_expert_ffn)(buffers, stacks, ops.fp8_gemms).reshape(e * rows, h)
  picked = torch.cat([out, out.new_zeros(1, h)])[dest].view(b * s, k, h)
  return (picked * weights_bsk.reshape(b * s, k, 1).to(picked.dtype)).sum(1)


class _Combine(torch.autograd.Function):
  """Each token's sum of its experts' outputs times their weights: out [T, h] (sorted slots),
  weight [T] fp32, token [T] -> [n, h] in out's dtype. Saves out once (index_add_ on the
  weighted product would save that product too: a second T h)."""

  @staticmethod
  def forward(ctx, out, weight, token, n):  # pylint: disable=arguments-differ
    ctx.save_for_backward(out, weight, token)
    weighted = (out * weight[:, None]).to(out.dtype)
    return out.new_zeros(n, out.shape[1]).index_add_(0, token, weighted)

  @staticmethod
  def backward(ctx, grad):  # pylint: disable=arguments-differ
    out, weight, token = ctx.saved_tensors
    picked = grad.index_select(0, token)
    grad_out = (picked * weight[:, None]).to(out.dtype) if ctx.needs_input_grad[0] else None
    grad_weight = (picked.float() * out.float()).sum(-1) if ctx.needs_input_grad[1] else None
    return grad_out, grad_weight, None, None
