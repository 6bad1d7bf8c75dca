"""Attention as pure functions: the causal / per-document / sliding masks, the scores' scale,
the core softmax(q k^T) v over grouped KV heads (SDPA or explicit, keyed dropout; gpt-oss's
sinks), and the self-attention sub-block around it (q/k/v projections, q/k norms, RoPE, the KV
cache, o_proj). Context parallelism passes its ring in place of the mask (`layers.Attend`).

Sinks (model.attention_sinks, gpt-oss): each head's learned logit `self_attn.sinks[n]` joins
every query's softmax as one more key whose value is zero, so a query may give weight to
nothing. SDPA has no such key: with sinks the explicit path runs (its s x s probabilities).
"""
import typing

import torch
import torch.nn.functional as F
from einops import rearrange

from model import layers, mla
from model.rope import apply_rope, interleaved_to_halves


def attention_mask(segment_ids_bs, s, window=0, device=None, chunk=0):
  """Causal mask [b or 1, 1, s, s] (True = attend), restricted to the same document when
  segments are given, to the last `window` positions (sliding window, HF's: query i sees
  keys i - window < j <= i) and to the query's own `chunk` of positions (Llama 4's chunked
  attention: floor(i / chunk) = floor(j / chunk)); None when plainly causal."""
  if segment_ids_bs is None and not window and not chunk:
    return None
  if segment_ids_bs is not None:
    device = segment_ids_bs.device
  mask = causal_mask_after(0, s, device, window, chunk)
  if segment_ids_bs is not None:
    mask = mask & (segment_ids_bs[:, :, None] == segment_ids_bs[:, None, :])[:, None]
  return mask


def causal_mask_after(past, s, device=None, window=0, chunk=0):
  """[1, 1, s, past + s]: new query i (position past + i) attends keys 0 .. past + i (the last
  `window` of them with a sliding window, those of its own `chunk` with chunked attention)."""
  keys, queries = torch.arange(past + s, device=device)[None], past + torch.arange(s, device=device)[:, None]
  mask = keys <= queries
  if window:
    mask = mask & (keys > queries - window)
  if chunk:
    mask = mask & (keys // chunk == queries // chunk)
  return mask[None, None]


class QueryScale(typing.NamedTuple):
  """Passed where a NoPE layer's RoPE tables would go: Llama 4's attention temperature, each
  position's queries times `scale` [1, 1, s, 1]."""
  scale: torch.Tensor


def temperature(cfg, positions_s):
  """Llama 4's attention temperature of positions p: log(floor((p + 1) / floor_scale) + 1) x
  attn_scale + 1 (1 up to floor_scale - 1, growing slowly past it)."""
  scale = torch.log1p(torch.floor((positions_s.float() + 1.0) / cfg.attn_floor_scale)) * cfg.attn_scale + 1.0
  return QueryScale(scale[None, None, :, None])


def attention_scale(cfg, d) -> float:
  """The scores' scale: 1 / sqrt(d), or Gemma's 1 / sqrt(query_pre_attn_scalar), or MLA's."""
  if mla.enabled(cfg):
    return mla.scale(cfg)
  return (cfg.get('query_pre_attn_scalar') or d) ** -0.5


def uses_sdpa(cfg, dropout=True) -> bool:
  """Whether core_attention runs F.scaled_dot_product_attention (`dropout`: attention dropout
  applies, as in training): not with sinks, nor with dropout."""
  return bool(cfg.fusions.flash_attention and not cfg.get('attention_sinks')
              and (cfg.attention_dropout == 0.0 or not dropout))


def core_attention(q_bnsd, k_bnsd, v_bnsd, mask_b1ss, cfg, layer, drop_key, sample_ids_b, mask_for_slice, sinks_n=None):
  """softmax(q k^T * scale) v over grouped KV heads, causal (and per-document / windowed if
  masked); `sinks_n`: this rank's heads' sink logits."""
  groups = q_bnsd.shape[1] // k_bnsd.shape[1]
  scale = attention_scale(cfg, q_bnsd.shape[-1])
  if isinstance(mask_b1ss, layers.Attend):
    return mask_b1ss.fn(q_bnsd, k_bnsd, v_bnsd, scale, sinks_n)
  if uses_sdpa(cfg, drop_key is not None):
    if mask_b1ss is None:
      return F.scaled_dot_product_attention(q_bnsd, k_bnsd, v_bnsd, is_causal=True, scale=scale,
                                            enable_gqa=groups > 1)
    return F.scaled_dot_product_attention(q_bnsd, k_bnsd, v_bnsd, attn_mask=mask_b1ss, scale=scale,
                                          enable_gqa=groups > 1)
  k_bnsd = k_bnsd.repeat_interleave(groups, dim=1)
  v_bnsd = v_bnsd.repeat_interleave(groups, dim=1)
  # Query-key layer scaling (Megatron) divides the scores by the layer number and multiplies
  # back inside an fp32 softmax: exact in fp32, it keeps fp16 scores from overflowing.
  coeff = float(layer + 1) if cfg.apply_query_key_layer_scaling else 1.0
  scores = (q_bnsd @ k_bnsd.transpose(-1, -2)) * (scale / coeff)
  s = q_bnsd.shape[2]
  if mask_b1ss is None:
    mask_b1ss = torch.ones(s, s, dtype=torch.bool, device=q_bnsd.device).tril()
  scores = scores.float().masked_fill(~mask_b1ss, float('-inf')) * coeff
  if sinks_n is None:
    probs = torch.softmax(scores, dim=-1).to(q_bnsd.dtype)
  else:               # one more column: the sink's logit, its probability dropped (a value of zero)
    sink = sinks_n.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q_bnsd.dtype)
  full = (cfg.num_attention_heads, s, s)
  probs = layers.dropout(probs, cfg.attention_dropout, drop_key, sample_ids_b, full, lambda m: mask_for_slice(m, 'heads'))
  return probs @ v_bnsd


def self_attention(params, prefix, x_bsh, cos_sin, mask, cfg, ops, layer, drop_key, sample_ids_b, kv=None):
  x_bsh = ops.full_input(x_bsh)
  if mla.enabled(cfg):
    q, k, v = mla.qkv(params, prefix, x_bsh, cos_sin, cfg, ops, drop_key, sample_ids_b)
  else:
    q, k, v = _qkv(params, prefix, x_bsh, cos_sin, cfg, ops, drop_key, sample_ids_b)
  if kv is not None:                   # generation: attend the cached positions too
    past, new = kv
    if past is not None:
      k, v = torch.cat([past.keys[layer], k], dim=2), torch.cat([past.values[layer], v], dim=2)
    new.keys[layer], new.values[layer] = k, v
  out = ops.recompute_attention(core_attention, q, k, v, mask, cfg, layer, drop_key and drop_key + ('attn',),
                                sample_ids_b, ops.mask_for_slice,
                                params[prefix + '.sinks'] if cfg.get('attention_sinks') else None)
  out = rearrange(out, 'b n s d -> b s (n d)')
  return layers.linear(params, prefix + '.o_proj', out, cfg, ops, 'row', drop_key, sample_ids_b)


def _qkv(params, prefix, x_bsh, cos_sin, cfg, ops, drop_key, sample_ids_b):
  """This rank's heads' q [b, n, s, d] and k, v [b, g, s, d] (q/k norms and RoPE applied)."""
  d = layers.head_dim(cfg)
  q, k, v = (layers.linear(params, f'{prefix}.{n}', x_bsh, cfg, ops, 'column', drop_key, sample_ids_b)
             for n in ('q_proj', 'k_proj', 'v_proj'))
  eps, offset, in_fp32 = cfg.layernorm_epsilon, cfg.get('rmsnorm_unit_offset', False), cfg.get('rmsnorm_scale_in_fp32', False)
  whole_projection = cfg.get('qk_norm') and cfg.get('qk_norm_span', 'head') == 'projection'
  if whole_projection:                  # OLMo 2: over all heads of q, of k (this rank's share: the sum over TP)
    q_width, k_width = cfg.num_attention_heads * d, (cfg.num_kv_heads or cfg.num_attention_heads) * d
    q = layers.rms_norm(q, params[prefix + '.q_norm.weight'], eps, offset, in_fp32, lambda s: ops.sum_over_heads(s, False) / q_width)
    k = layers.rms_norm(k, params[prefix + '.k_norm.weight'], eps, offset, in_fp32, lambda s: ops.sum_over_heads(s, True) / k_width)
  # Local head counts come from the (possibly TP-sharded) weights, not from the config.
  q, k, v = (rearrange(t, 'b s (n d) -> b n s d', d=d) for t in (q, k, v))
  if cfg.get('qk_norm') and not whole_projection:   # Gemma 3, Qwen3: over each head's dims
    q, k = (layers.rms_norm(t, params[f'{prefix}.{n}.weight'], eps, offset, in_fp32) for t, n in ((q, 'q_norm'), (k, 'k_norm')))
  if isinstance(cos_sin, QueryScale):      # Llama 4's NoPE layers: the queries' temperature
    q = (q * cos_sin.scale).to(q.dtype)
  elif cos_sin is not None:
    if cfg.get('rope_interleave'):         # Llama 4's rotary pairs (x0, x1), (x2, x3)...: as halves
      q, k = interleaved_to_halves(q), interleaved_to_halves(k)
    q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
    if cfg.get('qk_l2_norm'):              # Llama 4: q and k scaled to unit RMS per head, no weight
      q, k = (layers.rms_norm(t, t.new_ones(()), eps, scale_in_fp32=True) for t in (q, k))
  return q, k, v
