"""Mixture of experts: the feed-forward of every `model.moe.frequency`-th layer (Mixtral, Qwen2-MoE).

Parameters are transformers' own (5.x layout), so HF import is a rename:
  layers.N.mlp.gate.weight                [E, h]       the router (a linear layer, no bias)
  layers.N.mlp.experts.gate_proj          [E, f, h]    each expert's SwiGLU gate (HF 5 holds gate and
  layers.N.mlp.experts.up_proj            [E, f, h]    up as one [E, 2f, h] gate_up_proj: model/hf.py)
  layers.N.mlp.experts.down_proj          [E, h, f]
  layers.N.mlp.shared_expert.{gate,up,down}_proj.weight, layers.N.mlp.shared_expert_gate.weight [1, h]
                                                       Qwen2-MoE's always-on expert, scaled by sigmoid(gate x)
With model.has_bias (gpt-oss) every linear has a bias: the router's gate.bias [E], the experts'
experts.gate_proj_bias and up_proj_bias [E, f] (split like their stacks) and experts.down_proj_bias
[E, h], which is whole on every rank (not split over EP) and added after the TP reduction: each
token gets its experts' biases weighted as their outputs, once.
Experts are stacked on dim 0, so expert parallelism shards dim 0 (one box per rank); tensor
parallelism splits each expert as it splits the dense MLP (gate / up on f, down on its f
input: parallel/tensor.py), so a rank holds 1/(tp ep) of the experts.

Under TP every rank routes all of its tokens (the router is replicated) and runs its slice of
each expert: the experts' outputs, weighted and summed per token, are partial sums that one
reduction completes (all-reduce; reduce-scatter to the sequence slice under SP), as the dense
MLP's down_proj. The weights multiply partial outputs, so their gradient is summed over TP
(Ops.copy_to_tp); under SP, each rank's routing gradient comes from its own slice only
(_own_gradient), so the gather's reduce-scatter and the router's SP gradient sum count every
position once.

Routing, per token: p = softmax(router logits) (fp32; gpt-oss's softmax over the top-k logits is
this with normalize_top_k_affinities; router_activation=sigmoid: sigmoid, NxD's
Megatron Mixtral files), the top_k experts by p, their weights
p / sum(top-k p) with normalize_top_k_affinities (Mixtral; Qwen2-MoE's norm_topk_prob may be
off). Tokens are sorted by expert and each expert runs one matmul over its tokens
(`Ops.expert_ffn`: local here, all-to-all dispatched under expert parallelism).

Capacity (dropless=False; model/moe_dispatch.py): the unit is one sequence (a row of the batch), so which tokens drop
depends on the data alone, never on micro batch size, DP, EP, TP or PP:
  capacity C = ceil(capacity_factor * s * top_k / E)   tokens per expert per sequence of s tokens
an expert keeps the first C tokens of the row routed to it (by position; a token's top-k slots
go to distinct experts) and drops the rest; a dropped slot contributes 0 (the token keeps its
residual and its other experts).

Auxiliary losses (load balancing, router z-loss) and routing metrics: model/router_losses.py.
"""

import torch
import torch.nn.functional as F

from model import moe_dispatch, moe_kernels

# experts.down_proj_bias is whole on every rank: added after the TP reduction, at the token's own rank
WHOLE_EXPERT_TENSORS = ('.experts.down_proj_bias',)


def enabled(cfg) -> bool:
  # no truth test of the ConfigDict: its __len__ sorts its keys, which breaks model.compile's
  # block graph in two (dynamo cannot trace the sort)
  moe = cfg.get('moe')
  return moe is not None and moe.get('num_experts', 0) > 0


def is_moe_layer(cfg, i) -> bool:
  """Layer i is MoE when (i + 1) is a multiple of moe.frequency (HF Qwen2-MoE's decoder_sparse_step)
  and i is not among moe.dense_layers (HF's mlp_only_layers)."""
  return enabled(cfg) and (i + 1) % cfg.moe.frequency == 0 and i not in cfg.moe.get('dense_layers', ())


def moe_layers(cfg) -> list:
  return [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)]


def expert_ffn_size(cfg) -> int:
  return cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size


def adds_loss(cfg) -> bool:
  """Whether the auxiliary losses add to the objective (they need every MoE layer on one stage)."""
  moe = cfg.moe
  return (moe.output_router_logits and moe.router_aux_loss_coef > 0) or moe.router_z_loss_coef > 0


def specs(cfg, prefix, spec, std, out_std) -> dict:
  """ParamSpecs of layer `prefix`'s MoE feed-forward (`spec`: the ParamSpec class)."""
  h, e, f = cfg.hidden_size, cfg.moe.num_experts, expert_ffn_size(cfg)
  out = {prefix + '.gate.weight': spec((e, h), 'normal', std, layout='replicated'),    # the router
         prefix + '.experts.gate_proj': spec((e, f, h), 'normal', std, layout='expert_column'),
         prefix + '.experts.up_proj': spec((e, f, h), 'normal', std, layout='expert_column'),
         prefix + '.experts.down_proj': spec((e, h, f), 'normal', out_std, layout='expert_row')}
  if cfg.has_bias:
    out.update({prefix + '.gate.bias': spec((e,), 'zeros', layout='replicated'),
                prefix + '.experts.gate_proj_bias': spec((e, f), 'zeros', layout='expert_column'),
                prefix + '.experts.up_proj_bias': spec((e, f), 'zeros', layout='expert_column'),
                prefix + '.experts.down_proj_bias': spec((e, h), 'zeros', layout='replicated')})
  if cfg.moe.get('load_balance_bias'):        # chooses experts; never trained by a gradient (lora.UNTRAINED)
    out[prefix + '.gate.e_score_correction_bias'] = spec((e,), 'zeros', layout='replicated')
  shared = cfg.moe.shared_expert_intermediate_size
  if shared:
    sp = prefix + '.shared_expert'
    out.update({sp + '.gate_proj.weight': spec((shared, h), 'normal', std, layout='column'),
                sp + '.up_proj.weight': spec((shared, h), 'normal', std, layout='column'),
                sp + '.down_proj.weight': spec((h, shared), 'normal', out_std, layout='row')})
    if cfg.moe.get('shared_expert_gate', True):
      out[prefix + '.shared_expert_gate.weight'] = spec((1, h), 'normal', std, layout='replicated')
  return out


def is_expert_param(name) -> bool:
  """Stacked expert tensors: dim 0 is the expert (sharded under expert parallelism)."""
  return '.mlp.experts.' in name and not name.endswith(WHOLE_EXPERT_TENSORS)


def inactive_params(cfg) -> int:
  """Expert parameters a token does not use (top_k of num_experts run): FLOPs count the rest."""
  f, h = expert_ffn_size(cfg), cfg.hidden_size
  per_expert = 3 * f * h
  return len(moe_layers(cfg)) * (cfg.moe.num_experts - cfg.moe.top_k) * per_expert


def route(logits_bse, cfg, correction=None, ops=None):
  """(probs fp32 [b,s,E], top-k weights fp32 [b,s,k], top-k experts [b,s,k], kept [b,s,k] bool).
  `correction` [E] (DeepSeek-V3's load-balancing bias): added to the probabilities to choose the
  experts, not to their weights. With moe.num_groups > 1 (DeepSeek's n_group) the experts are
  chosen within the moe.top_k_groups groups whose two best scores sum highest. Under context
  parallelism (`ops.context_size` > 1) the capacity's queues run over the whole rows."""
  moe = cfg.moe
  logits = logits_bse.float()
  probs = torch.sigmoid(logits) if moe.router_activation == 'sigmoid' else torch.softmax(logits, dim=-1)
  choice = probs if correction is None else probs + correction.float()
  groups = moe.get('num_groups', 1)
  if groups > 1:
    per_group = choice.unflatten(-1, (groups, -1))
    best = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)        # [b, s, groups]
    chosen = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(moe.top_k_groups, dim=-1).indices, True)
    choice = per_group.masked_fill(~chosen[..., None], float('-inf')).flatten(-2)
  if choice is probs:
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)
  else:
    experts = torch.topk(choice, moe.top_k, dim=-1).indices
    weights = probs.gather(-1, experts)
  if moe.normalize_top_k_affinities:
    weights = weights / weights.sum(dim=-1, keepdim=True)
  if moe.get('routed_scaling_factor', 1.0) != 1.0:
    weights = weights * moe.routed_scaling_factor
  sliced = ops is not None and ops.context_size > 1
  b, s, k = experts.shape
  cap = moe_dispatch.capacity(cfg, s * ops.context_size if sliced else s)
  if cap >= s * (ops.context_size if sliced else 1):
    kept = torch.ones_like(experts, dtype=torch.bool)
  else:       # position of each (token, slot) in its expert's queue, in token order
    whole = ops.whole_rows(experts) if sliced else experts
    onehot = F.one_hot(whole.reshape(b, -1), moe.num_experts)
    kept = (onehot.cumsum(dim=1) * onehot).sum(-1).view(b, -1, k) <= cap
    kept = ops.context_slice(kept) if sliced else kept
  return probs, weights, experts, kept


def mlp(params, prefix, x_bsh, cfg, ops):
  """The MoE feed-forward of layer `prefix` on the whole sequence (under SP: gathered; the
  output is then this rank's slice); records routing in ops.moe."""
  moe = cfg.moe
  b, s, h = x_bsh.shape
  sliced = ops.residual_slices > 1
  own = (lambda t: _own_gradient(t, ops)) if sliced else (lambda t: t)
  logits = own(F.linear(x_bsh, params[prefix + '.gate.weight'], params[prefix + '.gate.bias'] if cfg.has_bias else None))
  correction = params[prefix + '.gate.e_score_correction_bias'] if moe.get('load_balance_bias') else None
  probs, weights, experts, kept = route(logits, cfg, correction, ops)
  if ops.moe is not None:
    ops.moe.record(logits, probs, experts, kept, prefix)
  # the experts' input: under TP without SP its gradient (partial per rank) is summed over TP
  flat_x = (x_bsh if sliced else ops.copy_to_tp(x_bsh)).reshape(b * s, h)
  stacks = experts_of(params, prefix, cfg)
  if moe_dispatch.fixed_buffers(cfg, x_bsh):
    combined = moe_dispatch.static_experts(flat_x, experts, ops.copy_to_tp(weights * kept), cfg, stacks, ops)
  else:
    combined = moe_dispatch.sorted_experts(flat_x, experts, weights, kept, cfg, stacks, ops)
  if moe.shared_expert_intermediate_size:
    sp = prefix + '.shared_expert'
    shared = F.linear(F.silu(F.linear(flat_x, params[sp + '.gate_proj.weight'])) *
                      F.linear(flat_x, params[sp + '.up_proj.weight']), params[sp + '.down_proj.weight'])
    if moe.get('shared_expert_gate', True):
      scale = own(F.linear(x_bsh, params[prefix + '.shared_expert_gate.weight'])).reshape(b * s, 1)
      shared = ops.copy_to_tp(torch.sigmoid(scale)) * shared
    combined = combined + shared
  out = ops.reduce_over_tp(combined.view(b, s, h))
  if cfg.has_bias:      # whole: once per token, after the reduction (SP: this rank's positions)
    down_bias = params[prefix + '.experts.down_proj_bias']
    term = ((weights * kept)[..., None] * down_bias[experts].float()).sum(2).to(out.dtype)
    # SP: this rank's positions, the gradient from them only (no exchange: the replicated layout sums it)
    out = out + (ops.mask_for_slice(term, 'seq') if sliced else term)
  return out


def experts_of(params, prefix, cfg) -> moe_kernels.Experts:
  """Layer `prefix`'s experts (this rank's boxes), with gpt-oss's biases and clamped SwiGLU where set."""
  e = f'{prefix}.experts.'
  clamp = (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) if cfg.moe.get('expert_activation') == 'clamped_swiglu' else ()
  biases = (params[e + 'gate_proj_bias'], params[e + 'up_proj_bias']) if cfg.has_bias else (None, None)
  return moe_kernels.Experts(params[e + 'gate_proj'], params[e + 'up_proj'], params[e + 'down_proj'], *biases, clamp)


def _own_gradient(x_bse, ops):
  """x itself (bitwise), whose gradient reaches only this rank's sequence slice (SP). Every TP
  rank records the whole sequence's routing; the auxiliary losses' gradients, summed over TP
  like every SP gradient, must come once from each position."""
  s = x_bse.shape[1]
  own = ops.mask_for_slice(torch.arange(s, device=x_bse.device)[None], 'seq')[0]
  mask = torch.zeros(s, dtype=x_bse.dtype, device=x_bse.device).index_fill(0, own, 1.0)[None, :, None]
  fixed = x_bse.detach()
  return fixed + mask * (x_bse - fixed)
