"""Rotary position embeddings: the inverse frequencies (with HF's scalings), the cos / sin
tables, the rotation, and the rope settings of an HF config.json read and written."""
import math

import torch


def rope_inv_freq(rot_dim, theta, scaling=None, seq_len=0, max_positions=0):
  """RoPE's inverse frequencies (float64), with HF's `linear`, `dynamic` or `llama3` scaling:
  llama3 keeps the high frequencies, divides the low ones by `factor`, and blends in between;
  dynamic (NTK) raises the base once `seq_len` (the batch's last position + 1, as HF) passes
  `max_positions`."""
  kind = scaling.type if scaling is not None else 'none'
  if kind == 'dynamic' and seq_len > max_positions:
    theta = theta * ((scaling.factor * seq_len / max_positions) - (scaling.factor - 1)) ** (rot_dim / (rot_dim - 2))
  inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
  if kind == 'linear':
    return inv_freq / scaling.factor
  if kind == 'llama3':
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
    return torch.where(medium, blended, scaled)
  return inv_freq


def rope_cos_sin(position_ids_bs, rot_dim, theta, dtype, scaling=None, max_positions=0):
  seq_len = int(position_ids_bs.max()) + 1 if scaling is not None and scaling.type == 'dynamic' else 0
  inv_freq = rope_inv_freq(rot_dim, theta, scaling, seq_len, max_positions)
  angles = position_ids_bs.double()[..., None] * inv_freq.to(position_ids_bs.device)
  angles = torch.cat([angles, angles], dim=-1)                        # rotate-half layout (HF)
  return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # [b, 1, s, r]


def apply_rope(x_bnsd, cos_b1sr, sin_b1sr):
  """Rotate the first r dims of each head (r = rotary_percentage * d), HF's rotate-half:
  x * cos + cat(-x2, x1) * sin, written half by half. The same products and sums, bit for bit
  (a + (-b) * s is a - b * s in IEEE arithmetic), without the rotated copy: compiled, the cat
  was a buffer of its own, each RoPE 2-3x slower than its bytes."""
  r = cos_b1sr.shape[-1]
  x1, x2 = x_bnsd[..., :r].chunk(2, dim=-1)
  c1, c2 = cos_b1sr.chunk(2, dim=-1)
  s1, s2 = sin_b1sr.chunk(2, dim=-1)
  halves = [x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]
  return torch.cat(halves + [x_bnsd[..., r:]] if r < x_bnsd.shape[-1] else halves, dim=-1)



# --- HF config.json ----------------------------------------------------------------------


ROPE_TYPES = ('default', 'linear', 'dynamic', 'llama3')   # HF rope_type values computed here


def _rope_entry(rope, key, theta=None):
  """(RoPE base, scaling settings) from one HF rope dict; scaled variants other than linear,
  dynamic and llama3 (yarn, longrope...) are refused by name."""
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"{key}.rope_type={rope_type!r} is not implemented (only {', '.join(ROPE_TYPES)})")
  if rope.get('partial_rotary_factor', 1.0) != 1.0:
    raise ValueError(f'{key}.partial_rotary_factor={rope["partial_rotary_factor"]} is not supported')
  theta, scaling = rope.get('rope_theta', theta), {'type': 'none'}
  if rope_type != 'default':
    scaling = {'type': rope_type, 'factor': float(rope['factor'])}
    if rope_type == 'llama3':
      scaling.update({k: float(rope[k]) for k in ('low_freq_factor', 'high_freq_factor')},
                     original_max_position_embeddings=int(rope['original_max_position_embeddings']))
  return theta, scaling


def from_hf(hf):
  """(RoPE base, scaling settings, sliding layers' base or 0) from either config layout:
  transformers 4.x (rope_theta, rope_scaling, Gemma's rope_local_base_freq) or 5.x
  (rope_parameters, per layer type for Gemma 3)."""
  params = hf.get('rope_parameters') or {}
  if 'full_attention' in params or 'sliding_attention' in params:       # 5.x, per layer type
    theta, scaling = _rope_entry(params.get('full_attention') or {}, 'rope_parameters.full_attention')
    local = params.get('sliding_attention') or {}
    local_theta, local_scaling = _rope_entry(local, 'rope_parameters.sliding_attention')
    if local_scaling['type'] != 'none':
      raise ValueError(f'rope_parameters.sliding_attention.rope_type={local_scaling["type"]!r}: '
                       'sliding layers with scaled RoPE are not supported')
  else:
    theta, scaling = hf.get('rope_theta'), {'type': 'none'}
    for key in ('rope_scaling', 'rope_parameters'):
      entry_theta, entry_scaling = _rope_entry(hf.get(key) or {}, key, theta)
      theta = entry_theta
      if entry_scaling['type'] != 'none':
        scaling = entry_scaling
    local_theta = hf.get('rope_local_base_freq')
  if hf.get('model_type') == 'gemma3_text':       # HF's defaults when a config omits them
    theta, local_theta = theta or 1e6, local_theta or 1e4
  return float(theta or 10000.0), scaling, float(local_theta or 0.0)


def to_hf(m) -> dict:
  """rope_scaling as HF writes it (None without scaling)."""
  r = m.get('rope_scaling')
  if r is None or r.type == 'none':
    return None
  out = {'rope_type': r.type, 'factor': r.factor}
  if r.type == 'llama3':
    out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
               original_max_position_embeddings=r.original_max_position_embeddings)
  return out


