"""Transformer building blocks as pure functions of (params, activations).

Shapes are in the names: b batch, s sequence, h hidden, n heads, d head dim, f ffn.
Linear weights use the Hugging Face layout [out, in]. Nothing here knows about
parallelism: the linear layers, embedding and cross-entropy come from an `Ops` value,
whose single-device version below is plain PyTorch (parallel/tensor.py supplies others).
"""
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

import host_values
import rng
from model import cross_entropy, lora
from numerics import fp8


def _row_linear(x, w, b=None, partial=None, gemms=None):
  out = fp8.linear(x, w, b, gemms)
  return out if partial is None else out + partial


def _embed(ids_bs, table_vh):
  return F.embedding(ids_bs, table_vh)


def _identity(x):
  return x


def _one_shard(x, op):  # pylint: disable=unused-argument
  return x


def no_recompute(fn, *args):
  return fn(*args)


@dataclasses.dataclass(frozen=True)
class Ops:
  """The parallelism-aware operations the model is built from, and its recompute hooks
  (single-device, no-recompute defaults)."""
  column_linear: Callable = fp8.linear  # output features sharded under TP; gemms=: numerics/fp8.py's
  row_linear: Callable = _row_linear   # input features sharded under TP; output reduced, with
                                       # `partial` (an adapter's share) added before the reduction
  fp8_gemms: dict = None               # {'column': Gemms, 'row': Gemms} for the block's linears (precision.fp8)
  embed: Callable = _embed             # vocab-sharded under TP
  lm_head: Callable = fp8.linear       # vocab-sharded logits
  cross_entropy: Callable = cross_entropy.per_token  # over (possibly vocab-sharded) logits
  vocab_reduce: Callable = _one_shard  # (x, 'max' | 'sum'): x reduced in place over the vocab shards
                                       # (the TP group); model/chunked_ce.py's loss pieces
  vocab_rank: int = 0                  # this rank's vocab shard: logit columns [rank w, (rank + 1) w)
  full_input: Callable = _identity     # the whole activations the linear layers read, from the
                                       # residual stream (which may be held in slices)
  slice_residual: Callable = _identity  # the slice of the residual stream this process holds
  residual_slices: int = 1             # the residual stream holds s / residual_slices positions
  mask_for_slice: Callable = lambda full_b_, kind: full_b_  # the part of a full-size dropout mask
                                       # this process applies; kind: 'seq' [b,s,..], 'ffn' [b,s,f],
                                       # 'heads' [b,n,s,s]
  # Selective recompute hooks, wrap(fn, *args): remat sets checkpointing ones.
  recompute_attention: Callable = no_recompute  # around core_attention
  recompute_mlp: Callable = no_recompute        # around the whole MLP
  recompute_norm: Callable = no_recompute       # around each of a block's two norms
  recompute_activation: Callable = no_recompute  # around act(gate) * up
  final_norm: Callable = None          # the model's last norm, norm's signature; None = norm (model.compile compiles it)
  # Mixture of experts (model/moe.py), through the experts this rank holds (None: local; EP: over the ep group)
  expert_ffn: Callable = None          # eager: (x_th sorted by expert, counts per expert, gate, up, down) -> y_th
  expert_buffers: Callable = None      # traced: ([E, R, h] buffers, gate, up, down) -> [E, R, h]
  copy_to_tp: Callable = _identity     # x, its gradient summed over TP (Megatron's f; MoE's partial sums)
  reduce_over_tp: Callable = _identity  # partial sums -> output: all-reduce, or reduce-scatter under SP
  moe: object = None                   # the stage's router_losses.Collector (set by transformer.stage)
  expert_loads: bool = False           # training passes count each MoE layer's kept tokens per expert (per-layer stats)
  moe_tally: object = None             # dict: the pass's MoE metric sums (set by the caller)
  # Context parallelism (parallel/context.py): (batch, window, chunk) -> Attend, the attention of a
  # layer over the sequence whose slice this rank holds; None = attention over what is here.
  context_attention: Callable = None
  # Dropout at cp > 1: masks are drawn for the whole sequence (context_size times this rank's
  # length) and `context_slice(mask [b, S, ...])` keeps this rank's positions, so every rank
  # applies the one-device mask's entries for its tokens.
  context_size: int = 1
  context_slice: Callable = None
  # x [b, s, ...] -> [b, S, ...]: the whole rows this rank holds slices of, in sequence order
  # (MoE capacity's queues over each row)
  whole_rows: Callable = None
  # A sum over the features of a projection's heads (OLMo 2's q/k norms) where this process holds
  # some of its heads: (partial sums, whether of the KV heads) -> the sum over the TP group (each
  # KV head counted once where kv_replicator ranks hold it); its gradient summed back the same way.
  sum_over_heads: Callable = lambda partial, kv: partial
  # Sums over a row's positions held by other cp ranks (preference objectives' per-row
  # log-prob sums): a differentiable all-reduce whose backward is the identity.
  row_sum: Callable = _identity


LOCAL_OPS = Ops()


@dataclasses.dataclass(frozen=True)
class Attend:
  """Attention done elsewhere, passed where the mask goes: fn(q, k, v, scale, sinks or None) ->
  out (the ring of context parallelism, which builds its masks block by block)."""
  fn: Callable


# --- norms -------------------------------------------------------------------------


def rms_norm(x_bsh, weight_h, eps, unit_offset=False, scale_in_fp32=False, mean_square_of=None):
  """Llama scales the normalized x (cast back) by w; Gemma scales by 1 + w in fp32, then casts;
  OLMo 2 (`scale_in_fp32`) by w in fp32, then casts. `mean_square_of(x² summed over the last dim)`:
  the mean over all the features the norm spans where this process holds some of them (TP: the
  sum over the group divided by the whole width, not by this rank's share of the weight)."""
  x = x_bsh.float()
  if mean_square_of is None:
    mean_square = x.pow(2).mean(-1, keepdim=True)
  else:
    mean_square = mean_square_of(x.pow(2).sum(-1, keepdim=True))
  x = x * torch.rsqrt(mean_square + eps)
  if unit_offset:
    return (x * (1.0 + weight_h.float())).to(x_bsh.dtype)
  if scale_in_fp32:
    return (weight_h * x).to(x_bsh.dtype)
  return weight_h * x.to(x_bsh.dtype)


def layer_norm(x_bsh, weight_h, bias_h, eps):
  return F.layer_norm(x_bsh, (x_bsh.shape[-1],), weight_h, bias_h, eps)


def norm(params, prefix, x_bsh, cfg):
  if cfg.normalization == 'rmsnorm':
    return rms_norm(x_bsh, params[prefix + '.weight'], cfg.layernorm_epsilon, cfg.get('rmsnorm_unit_offset', False),
                    cfg.get('rmsnorm_scale_in_fp32', False))
  return layer_norm(x_bsh, params[prefix + '.weight'], params[prefix + '.bias'], cfg.layernorm_epsilon)


# --- dropout -------------------------------------------------------------------------


def has_dropout(cfg) -> bool:
  peft = lora.settings(cfg)
  return max(cfg.hidden_dropout, cfg.attention_dropout, cfg.ffn_dropout, lora.option(peft, 'lora_dropout') if peft else 0) > 0


def head_dim(cfg) -> int:
  return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def dropout(x_b_, p, key, sample_ids_b, full_shape=None, mask_for_slice=None, ops=None):
  """Dropout whose mask for sample i is a pure function of (key, global sample index i).

  Keying by sample index (not by rank or micro batch) makes every DP degree, micro
  batch size and recompute pass draw the same mask as one device. Where the activations
  are a slice of the whole, the whole mask is drawn (`full_shape` per sample) and
  `mask_for_slice` picks the part that applies. With `ops` at cp > 1 the first dim of the
  shape is this rank's share of the sequence: the whole sequence's mask is drawn and cut first.
  """
  if p == 0.0 or key is None:
    return x_b_
  draw = untraced_keep_mask if torch.compiler.is_compiling() and untraced_keep_mask else _keep_mask
  shape = tuple(full_shape or x_b_.shape[1:])
  cp = ops.context_size if ops is not None else 1
  keep = draw((shape[0] * cp,) + shape[1:], p, key, sample_ids_b)
  if cp > 1:
    keep = ops.context_slice(keep)
  if mask_for_slice is not None:
    keep = mask_for_slice(keep)
  return x_b_ * keep.to(x_b_.device) / (1.0 - p)


# model.compile (parallel/compiled.py) sets this to _keep_mask excluded from tracing, so the keyed
# host-side draws run eagerly between its graphs; set there, plain runs never import torch._dynamo.
untraced_keep_mask = None


def _keep_mask(shape, p, key, sample_ids_b):
  # model.compile passes the layer index as a tensor, so one graph serves every layer: key as eager's
  key = tuple(int(k) if torch.is_tensor(k) else k for k in key)
  ids = host_values.read(sample_ids_b, lambda t: t.tolist(), 'the sample ids keying dropout (the masks\' shapes, '
                         'not their values)', lambda: list(range(sample_ids_b.shape[0])))
  # each sample's draw compared as it is made: one fp32 draw alive at a time, not all and their stack
  return torch.stack([rng.uniform(shape, *key, i) >= p for i in ids])


# --- linear layers (with LoRA adapters where the params have them) ---------------------------


def linear(params, name, x_bs_, cfg, ops, parallel, drop_key=None, sample_ids_b=None):
  """Linear layer `name` ('column' or 'row' parallel in ops' terms) plus its LoRA adapter, if
  any. A row-parallel adapter's output is a partial sum like the base's: it joins the base
  layer's reduction instead of needing its own."""
  w, b = params[name + '.weight'], params.get(name + '.bias')

  def adapter_dropout(x, p, site):
    if not drop_key or p == 0.0:
      return x
    key = drop_key + ('lora', site)    # the adapted module: Phi-3's q, k, v share qkv_proj's mask
    if parallel == 'column':                 # the input is whole on every rank
      return dropout(x, p, key, sample_ids_b, ops=ops)
    # A row-parallel input is this rank's share of the features: draw the whole mask, apply its part.
    latent = cfg.get('mla') is not None and cfg.mla.get('kv_lora_rank', 0) > 0    # o_proj reads v_head_dim a head
    width = cfg.ffn_hidden_size if name.endswith('down_proj') else \
        cfg.num_attention_heads * (cfg.mla.v_head_dim if latent else head_dim(cfg))
    return dropout(x, p, key, sample_ids_b, x.shape[1:-1] + (width,), lambda m: ops.mask_for_slice(m, 'ffn'), ops)

  first = ops.column_linear if parallel == 'column' else F.linear   # A reads what the base layer reads
  extra = lora.delta(params, name, x_bs_, cfg, adapter_dropout, first)
  in_fp8 = {'gemms': ops.fp8_gemms[parallel]} if ops.fp8_gemms else {}     # (a plain F.linear still plugs in)
  if parallel == 'column':
    out = ops.column_linear(x_bs_, w, b, **in_fp8)
    return out if extra is None else out + extra
  return ops.row_linear(x_bs_, w, b, extra, **in_fp8)


# --- MLP -----------------------------------------------------------------------------------


GATED = {'swiglu': F.silu,                                          # Llama, Mistral, Qwen2
         'geglu': lambda x: F.gelu(x, approximate='tanh')}          # Gemma (gelu_pytorch_tanh)


def mlp(params, prefix, x_bsh, cfg, ops, drop_key, sample_ids_b):
  return ops.recompute_mlp(_mlp, params, prefix, x_bsh, cfg, ops, drop_key, sample_ids_b)


def _gated(gate_bsf, up_bsf, activation):
  return GATED[activation](gate_bsf) * up_bsf


def _mlp(params, prefix, x_bsh, cfg, ops, drop_key, sample_ids_b):
  x_bsh = ops.full_input(x_bsh)
  up_bsf = linear(params, prefix + '.up_proj', x_bsh, cfg, ops, 'column', drop_key, sample_ids_b)
  if cfg.activation in GATED:
    gate_bsf = linear(params, prefix + '.gate_proj', x_bsh, cfg, ops, 'column', drop_key, sample_ids_b)
    inner_bsf = ops.recompute_activation(_gated, gate_bsf, up_bsf, cfg.activation)
  else:
    inner_bsf = F.gelu(up_bsf)
  inner_bsf = dropout(inner_bsf, cfg.ffn_dropout, drop_key and drop_key + ('ffn',), sample_ids_b,
                      (x_bsh.shape[1], cfg.ffn_hidden_size), lambda m: ops.mask_for_slice(m, 'ffn'), ops)
  return linear(params, prefix + '.down_proj', inner_bsf, cfg, ops, 'row', drop_key, sample_ids_b)
