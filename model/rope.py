"""Rotary position embeddings: the inverse frequencies (with HF's scalings), the cos / sin
tables, the rotation, and the rope settings of an HF config.json read and written."""
import math

import torch


def rope_inv_freq(rot_dim, theta, scaling=None, seq_len=0, max_positions=0):
  """RoPE's inverse frequencies (float64), with HF's `linear`, `dynamic`, `llama3`, `yarn` or
  `longrope` scaling: llama3 keeps the high frequencies, divides the low ones by `factor`, and
  blends in between; dynamic (NTK) raises the base once `seq_len` (the batch's last position + 1,
  as HF) passes `max_positions`; longrope divides by its long factors once `seq_len` passes
  original_max_position_embeddings, by its short ones up to it."""
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
  if kind == 'yarn':
    ramp = _yarn_ramp(rot_dim, theta, scaling)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
  if kind == 'longrope':
    long = seq_len > scaling.original_max_position_embeddings
    return inv_freq / torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
  return inv_freq


def _yarn_ramp(rot_dim, theta, scaling):
  """YaRN's share of interpolation per frequency (HF's _compute_yarn_parameters): 0 for the dims
  that turn more than beta_fast times over the original context (kept), 1 for those turning
  fewer than beta_slow times (divided by factor), linear in the dim index between."""
  def dim_turning(turns):     # the (fractional) dim whose wavelength fits `turns` times in the context
    original = scaling.original_max_position_embeddings
    return rot_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
  low, high = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rot_dim - 1)
  if low == high:
    high += 0.001             # HF's guard against a zero-width ramp
  return ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)


def attention_factor(scaling) -> float:
  """What HF multiplies cos and sin by (so each score by its square): YaRN's mscale and
  longrope's factor, 1 for the other scalings. scaling.attention_factor=0 derives it as HF:
  YaRN 0.1 ln(factor) + 1 (or the ratio of mscale's to mscale_all_dim's, DeepSeek's, when
  both are set), longrope sqrt(1 + ln(factor) / ln(original_max_position_embeddings))."""
  kind = scaling.type if scaling is not None else 'none'
  if kind not in ('yarn', 'longrope'):
    return 1.0
  if scaling.attention_factor:
    return scaling.attention_factor
  factor = scaling.factor
  if factor <= 1:
    return 1.0
  if kind == 'longrope':
    return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))
  def mscale(m):
    return 0.1 * m * math.log(factor) + 1.0
  if scaling.mscale and scaling.mscale_all_dim:
    return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
  return mscale(1)


def rope_cos_sin(position_ids_bs, rot_dim, theta, dtype, scaling=None, max_positions=0):
  """cos, sin [b, 1, s, r] of `position_ids_bs`, times the scaling's attention factor (as HF)."""
  kind = scaling.type if scaling is not None else 'none'
  seq_len = int(position_ids_bs.max()) + 1 if kind in ('dynamic', 'longrope') else 0
  inv_freq = rope_inv_freq(rot_dim, theta, scaling, seq_len, max_positions)
  angles = position_ids_bs.double()[..., None] * inv_freq.to(position_ids_bs.device)
  angles = torch.cat([angles, angles], dim=-1)                        # rotate-half layout (HF)
  scale = attention_factor(scaling)
  return (angles.cos() * scale).to(dtype)[:, None], (angles.sin() * scale).to(dtype)[:, None]


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


def interleaved_to_halves(x):
  """(x0, x1), (x2, x3)... -> (x0, x2, ..., x1, x3, ...): rotary pairs stored side by side (the
  complex-number RoPE of Llama 4's and DeepSeek's files) as rotate-half's halves. The queries and
  keys are permuted alike, so their products are unchanged."""
  return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def longrope_problems(scaling, rot_dim, key) -> list:
  """longrope's factor lists must hold one factor per rotated frequency (rot_dim / 2)."""
  return [f'{key}.{name} has {len(scaling[name])} entries; longrope needs one per rotated frequency, '
          f'rot_dim / 2 = {rot_dim // 2}' for name in ('short_factor', 'long_factor')
          if len(scaling[name]) != rot_dim // 2]



# --- HF config.json ----------------------------------------------------------------------


ROPE_TYPES = ('default', 'linear', 'dynamic', 'llama3', 'yarn', 'longrope')   # HF rope_type values computed here
ORIGINAL_CONTEXT_TYPES = ('llama3', 'yarn', 'longrope')      # the types that read original_max_position_embeddings


def _rope_entry(rope, key, hf, theta=None):
  """(RoPE base, scaling settings, rotary fraction) from one HF rope dict, with transformers
  5.x's defaults; other scaled variants (proportional, mrope...) are refused by name."""
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"{key}.rope_type={rope_type!r} is not implemented (only {', '.join(ROPE_TYPES)})")
  # 5.x: the dict's partial_rotary_factor, else the top-level one (4.x reads only that)
  fraction_key = f'{key}.partial_rotary_factor' if 'partial_rotary_factor' in rope else 'partial_rotary_factor'
  fraction = rope.get('partial_rotary_factor', hf.get('partial_rotary_factor'))
  fraction = 1.0 if fraction is None else float(fraction)
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f'{fraction_key}={fraction} must be in (0, 1]')
  if fraction < 1.0:
    head_dim = hf.get('head_dim') or hf['hidden_size'] // hf['num_attention_heads']
    if int(head_dim * fraction) % 2:
      raise ValueError(f'{fraction_key}={fraction} rotates int({head_dim} x {fraction}) = '
                       f'{int(head_dim * fraction)} dims per head, an odd count (HF rounds its frequencies up, '
                       'flatron rotates pairs); use a fraction that gives an even count')
  theta, scaling = rope.get('rope_theta', theta), {'type': 'none'}
  if rope_type == 'default':
    return theta, scaling, fraction
  scaling, factor = {'type': rope_type}, rope.get('factor')
  if rope_type in ORIGINAL_CONTEXT_TYPES:
    # 5.x puts a top-level original_max_position_embeddings over the dict's (Phi-3 keeps it
    # there; its config class defaults it to 4096); with neither, max_position_embeddings
    max_positions = hf.get('max_position_embeddings', 2048)
    top = hf.get('original_max_position_embeddings', 4096 if hf.get('model_type') == 'phi3' else None)
    original = int(top or rope.get('original_max_position_embeddings') or max_positions)
    scaling['original_max_position_embeddings'] = original
    if factor is None and rope_type in ('yarn', 'longrope'):     # HF: the context's growth
      factor = max_positions / original
  if factor is None:
    raise ValueError(f'{key}.factor is missing: rope_type {rope_type!r} needs it')
  scaling['factor'] = float(factor)
  if rope_type == 'llama3':
    scaling.update({k: float(rope[k]) for k in ('low_freq_factor', 'high_freq_factor')})
  if rope_type in ('yarn', 'longrope'):
    attention = rope.get('attention_factor')
    if attention is not None and not attention > 0:
      raise ValueError(f'{key}.attention_factor={attention} must be > 0 (it multiplies cos and sin); '
                       'leave it out for the derived one')
    scaling['attention_factor'] = float(attention or 0.0)       # 0: derived as HF
  if rope_type == 'yarn':
    # HF: 0 or None mean the defaults 32 and 1; an absent truncate is True, None false
    scaling.update(beta_fast=float(rope.get('beta_fast') or 32), beta_slow=float(rope.get('beta_slow') or 1),
                   mscale=float(rope.get('mscale') or 0), mscale_all_dim=float(rope.get('mscale_all_dim') or 0),
                   truncate=bool(rope.get('truncate', True)))
  if rope_type == 'longrope':
    for name in ('short_factor', 'long_factor'):
      if not rope.get(name):
        raise ValueError(f'{key}.{name} is missing: longrope needs a factor per rotated frequency')
      scaling[name] = tuple(float(x) for x in rope[name])
    head_dim = hf.get('head_dim') or hf['hidden_size'] // hf['num_attention_heads']
    problems = longrope_problems(scaling, int(head_dim * fraction) // 2 * 2, key)
    if problems:
      raise ValueError(problems[0])
  return theta, scaling, fraction


def from_hf(hf):
  """(RoPE base, scaling settings, sliding layers' base or 0, rotary fraction) from either
  config layout: transformers 4.x (rope_theta, rope_scaling, top-level partial_rotary_factor,
  Gemma's rope_local_base_freq) or 5.x (rope_parameters, per layer type for Gemma 3)."""
  params = hf.get('rope_parameters') or {}
  if 'full_attention' in params or 'sliding_attention' in params:       # 5.x, per layer type
    full = params.get('full_attention') or {}
    theta, scaling, fraction = _rope_entry(full, 'rope_parameters.full_attention', hf)
    local = params.get('sliding_attention') or {}
    local_theta, local_scaling, local_fraction = _rope_entry(local, 'rope_parameters.sliding_attention', hf)
    if local_scaling['type'] != 'none':
      raise ValueError(f'rope_parameters.sliding_attention.rope_type={local_scaling["type"]!r}: '
                       'sliding layers with scaled RoPE are not supported')
    if local_fraction != fraction:
      raise ValueError(f'rope_parameters.sliding_attention.partial_rotary_factor={local_fraction} differs from '
                       f'full_attention\'s {fraction}: flatron rotates one fraction in every layer')
    if not scaling.get('truncate', True):
      # HF reads truncate from the outer dict only, so per layer type it is always True
      raise ValueError('rope_parameters.full_attention.truncate=False: transformers ignores it per layer type '
                       '(always truncates); leave it out')
  else:
    # 5.x reads rope_scaling when set (4.x's key), else rope_parameters; rope_theta fills the base
    key = 'rope_scaling' if hf.get('rope_scaling') else 'rope_parameters'
    theta, scaling, fraction = _rope_entry(hf.get(key) or {}, key, hf, hf.get('rope_theta'))
    local_theta = hf.get('rope_local_base_freq')
  if hf.get('model_type') == 'gemma3_text':       # HF's defaults when a config omits them
    theta, local_theta = theta or 1e6, local_theta or 1e4
  return float(theta or 10000.0), scaling, float(local_theta or 0.0), fraction


def to_hf(m) -> dict:
  """The rope dict as HF writes it (4.x's rope_scaling, 5.x's rope_parameters without
  rope_theta), or None for full-width RoPE without scaling."""
  r = m.get('rope_scaling')
  kind = r.type if r is not None else 'none'
  out = {'rope_type': 'default' if kind == 'none' else kind}
  if kind != 'none':
    out['factor'] = r.factor
  if kind in ORIGINAL_CONTEXT_TYPES:
    out['original_max_position_embeddings'] = r.original_max_position_embeddings
  if kind == 'llama3':
    out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
  if kind == 'yarn':
    out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
    out.update({k: r[k] for k in ('mscale', 'mscale_all_dim') if r[k]})
    if not r.truncate:
      out['truncate'] = False
  if kind == 'longrope':
    out.update(short_factor=list(r.short_factor), long_factor=list(r.long_factor))
  if kind in ('yarn', 'longrope') and r.attention_factor:
    out['attention_factor'] = r.attention_factor
  if m.rotary_percentage != 1.0:
    out['partial_rotary_factor'] = m.rotary_percentage
  return out if len(out) > 1 else None


def to_hf_top_level(m) -> dict:
  """The keys transformers 4.x reads only at config.json's top level: partial_rotary_factor,
  and longrope's original_max_position_embeddings (its switch to the long factors); 5.x reads
  them there too, the same values as in the rope dict."""
  out = {}
  if m.rotary_percentage != 1.0:
    out['partial_rotary_factor'] = m.rotary_percentage
  r = m.get('rope_scaling')
  if r is not None and r.type == 'longrope':
    out['original_max_position_embeddings'] = r.original_max_position_embeddings
  return out
