"""Multi-head latent attention (DeepSeek-V2 / V3; model.mla, on when mla.kv_lora_rank > 0).

Queries pass a low-rank bottleneck (q_lora_rank; 0: one q_proj), keys and values are expanded
per head from one shared latent of kv_lora_rank, and RoPE turns a separate part of each query
and key (qk_rope_head_dim), whose key part all heads share:

  q_i = [q_nope_i, rope(q_rot_i)]   from q_b_proj(norm(q_a_proj(x)))  (or q_proj(x))
  k_i = [k_nope_i, rope(k_rot)]     k_nope_i, v_i from kv_b_proj(norm(latent)); latent, k_rot
                                    from kv_a_proj_with_mqa(x)
  out = o_proj(softmax(q k^T scale) v), scale = (nope + rope)^-1/2, times YaRN's
        mscale(factor, mscale_all_dim)^2 where rope_scaling sets mscale_all_dim (DeepSeek-V3's)

Parameters (HF's names and layouts) and how they lie over TP:
  self_attn.q_a_proj.weight            [q_lora, h]                  tp_partial
  self_attn.q_a_layernorm.weight       [q_lora]                     tp_partial
  self_attn.q_b_proj.weight            [n (nope + rope), q_lora]    column: heads split
  self_attn.kv_a_proj_with_mqa.weight  [kv_lora + rope, h]          tp_partial
  self_attn.kv_a_layernorm.weight      [kv_lora]                    tp_partial
  self_attn.kv_b_proj.weight           [n (nope + v), kv_lora]      column
  self_attn.o_proj.weight              [h, n v]                     row
The down projections and their norms are whole on every TP rank, each computing the small
latents itself (splitting them would need a reduction over TP before each norm); their
gradients come from the rank's heads only and are summed over TP (tp_partial), as the input's
are by the region's entry. With rope_interleave (DeepSeek's files) the rotary dims come in
pairs (x0, x1), (x2, x3)...: they are de-interleaved before the rotate-half RoPE, as HF does.
"""
import math

import torch
from einops import rearrange

from model import layers
from model.rope import apply_rope, interleaved_to_halves


def enabled(cfg) -> bool:
  mla = cfg.get('mla')
  return mla is not None and mla.get('kv_lora_rank', 0) > 0


def qk_head_dim(cfg) -> int:
  return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim


def scale(cfg) -> float:
  """The scores' scale: 1 / sqrt(nope + rope), with YaRN's mscale_all_dim correction squared."""
  out = qk_head_dim(cfg) ** -0.5
  r = cfg.get('rope_scaling')
  if r is not None and r.type == 'yarn' and r.get('mscale_all_dim') and r.factor > 1:
    out *= (0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0) ** 2
  return out


def specs(cfg, prefix, spec, std, out_std) -> dict:
  """ParamSpecs of layer `prefix`'s MLA (`spec`: the ParamSpec class), in forward order."""
  m, h, n = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
  out = {}
  if m.q_lora_rank:
    out[prefix + '.q_a_proj.weight'] = spec((m.q_lora_rank, h), 'normal', std, layout='tp_partial')
    out[prefix + '.q_a_layernorm.weight'] = spec((m.q_lora_rank,), 'ones', layout='tp_partial')
    out[prefix + '.q_b_proj.weight'] = spec((n * qk_head_dim(cfg), m.q_lora_rank), 'normal', std, layout='column')
  else:
    out[prefix + '.q_proj.weight'] = spec((n * qk_head_dim(cfg), h), 'normal', std, layout='column')
  out[prefix + '.kv_a_proj_with_mqa.weight'] = spec((m.kv_lora_rank + m.qk_rope_head_dim, h), 'normal', std,
                                                    layout='tp_partial')
  out[prefix + '.kv_a_layernorm.weight'] = spec((m.kv_lora_rank,), 'ones', layout='tp_partial')
  out[prefix + '.kv_b_proj.weight'] = spec((n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), 'normal', std,
                                           layout='column')
  out[prefix + '.o_proj.weight'] = spec((h, n * m.v_head_dim), 'normal', out_std, layout='row')
  return out


def qkv(params, prefix, x_bsh, cos_sin, cfg, ops, drop_key, sample_ids_b):
  """This rank's heads' q, k [b, n, s, nope + rope] (RoPE applied) and v [b, n, s, v_head_dim]
  from the whole input (`ops.full_input` done)."""
  m = cfg.mla
  eps = cfg.layernorm_epsilon
  lin = lambda name, x: layers.linear(params, f'{prefix}.{name}', x, cfg, ops, 'column', drop_key, sample_ids_b)
  if m.q_lora_rank:
    q = lin('q_b_proj', layers.rms_norm(lin('q_a_proj', x_bsh), params[prefix + '.q_a_layernorm.weight'], eps))
  else:
    q = lin('q_proj', x_bsh)
  latent, k_rot = lin('kv_a_proj_with_mqa', x_bsh).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
  kv = lin('kv_b_proj', layers.rms_norm(latent, params[prefix + '.kv_a_layernorm.weight'], eps))
  q = rearrange(q, 'b s (n d) -> b n s d', d=qk_head_dim(cfg))
  kv = rearrange(kv, 'b s (n d) -> b n s d', d=m.qk_nope_head_dim + m.v_head_dim)
  q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
  k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
  k_rot = k_rot[:, None]                                     # [b, 1, s, rope]: every head's
  if m.rope_interleave:
    q_rot, k_rot = interleaved_to_halves(q_rot), interleaved_to_halves(k_rot)
  if cos_sin is not None:
    q_rot, k_rot = apply_rope(q_rot, *cos_sin), apply_rope(k_rot, *cos_sin)
  q = torch.cat([q_nope, q_rot], dim=-1)
  k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
  return q, k, v
