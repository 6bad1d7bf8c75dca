"""LoRA (Hu et al. 2021) exactly as peft computes it, on the flat parameter dict.

A targeted linear `W` (name `<prefix>.<module>.weight`, [out, in]) gets two parameters named
as peft names them, `<prefix>.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]:

    y = W x + b + scaling * B (A dropout(x)),   scaling = alpha / r  (alpha / sqrt(r): rsLoRA)

A starts as peft's kaiming-uniform (uniform in +-1/sqrt(in)), B at zero, so step 0 is the base
model. The base is frozen; adapters are fp32 parameters whatever the recipe (the base may be
bf16) and compute in the activations' dtype. Settings come from `cfg.peft`, the
model_alignment_strategy.peft section. Nothing here knows about parallelism: parallel/tensor.py
decides which box of A and B a rank holds (Megatron's way: A replicated and B split for
column-parallel targets, A split and B replicated for row-parallel ones) and the adapter's
partial output of a row-parallel target joins the base layer's own reduction (`layers.linear`).
"""
import math

import torch
import torch.nn.functional as F

# NxD Training's fused names and peft's per-projection names, and what each covers.
TARGET_GROUPS = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'gate_up_proj': ('gate_proj', 'up_proj'),
                 'all-linear': ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')}
MODULES = TARGET_GROUPS['all-linear']
BIASES = ('none', 'all', 'lora_only')
FACTORS = ('lora_A', 'lora_B')


def settings(cfg):
  """The peft section of model config `cfg`, or None when LoRA is off."""
  peft = cfg.get('peft') if hasattr(cfg, 'get') else None
  return peft if peft is not None and peft.get('lora_rank', 0) > 0 else None


def target_modules(peft) -> tuple:
  """The projections (q_proj, ..., down_proj) the adapters target; unknown names raise."""
  names = (peft.target_modules,) if isinstance(peft.target_modules, str) else tuple(peft.target_modules)
  out = []
  for name in names:
    expanded = TARGET_GROUPS.get(name, (name,))
    for module in expanded:
      if module not in MODULES:
        valid = ', '.join(list(TARGET_GROUPS) + list(MODULES))
        raise ValueError(f'model_alignment_strategy.peft.target_modules: {name!r} is unknown; valid: {valid}')
      if module not in out:
        out.append(module)
  return tuple(m for m in MODULES if m in out)


def scaling(peft) -> float:
  r = peft.lora_rank
  return peft.lora_alpha / (math.sqrt(r) if peft.use_rslora else r)


def split_name(name):
  """'layers.0.self_attn.q_proj.lora_A.weight' -> ('layers.0.self_attn.q_proj', 'lora_A'); else None."""
  parts = name.split('.')
  if len(parts) >= 3 and parts[-2] in FACTORS:
    return '.'.join(parts[:-2]), parts[-2]
  return None


def is_adapter(name) -> bool:
  return split_name(name) is not None


def adapter_specs(cfg, base_specs, spec_type) -> dict:
  """name -> spec of every adapter factor, for the targeted linear weights in `base_specs`."""
  peft = settings(cfg)
  if peft is None:
    return {}
  targets = target_modules(peft)
  out = {}
  for name, spec in base_specs.items():
    parts = name.split('.')
    if name.startswith('layers.') and parts[-1] == 'weight' and parts[-2] in targets:
      linear = name[:-len('.weight')]
      out_dim, in_dim = spec.shape
      out[f'{linear}.lora_A.weight'] = spec_type((peft.lora_rank, in_dim), 'uniform', 1.0 / math.sqrt(in_dim))
      out[f'{linear}.lora_B.weight'] = spec_type((out_dim, peft.lora_rank), 'zeros')
  return out


def trainable(cfg, names) -> list:
  """The names that train: with LoRA the adapters (and the biases `lora_bias` names), else all."""
  peft = settings(cfg)
  if peft is None:
    return list(names)
  names = list(names)
  adapted = {split_name(n)[0] for n in names if is_adapter(n)}
  keep = []
  for n in names:
    if is_adapter(n):
      keep.append(n)
    elif n.endswith('.bias') and (peft.lora_bias == 'all' or
                                  (peft.lora_bias == 'lora_only' and n[:-len('.bias')] in adapted)):
      keep.append(n)
  return keep


def delta(params, linear, x, cfg, dropout):
  """The adapter's contribution to `linear`'s output for input `x` (None if not adapted):
  scaling * B (A dropout(x)), in x's dtype. `dropout(x, site)` applies the keyed dropout."""
  a = params.get(linear + '.lora_A.weight')
  if a is None:
    return None
  peft = cfg.peft
  x = dropout(x, peft.lora_dropout)
  b = params[linear + '.lora_B.weight']
  return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * scaling(peft)


def merged(params, cfg) -> dict:
  """Base weights with every adapter folded in (W + scaling B A), without the adapter
  factors: the full model that equals base + adapters (needs whole, unsharded tensors)."""
  peft = settings(cfg)
  out = {n: p for n, p in params.items() if not is_adapter(n)}
  if peft is None:
    return out
  s = scaling(peft)
  for name in params:
    split = split_name(name)
    if split and split[1] == 'lora_A':
      w = params[split[0] + '.weight']
      product = params[split[0] + '.lora_B.weight'].double() @ params[name].double()
      out[split[0] + '.weight'] = (w.double() + s * product).to(w.dtype)
  return out


def param_dtype(name, base_dtype):
  """Adapters are fp32 whatever the recipe; the (frozen) base keeps the recipe's dtype."""
  return torch.float32 if is_adapter(name) else base_dtype


def stored(cfg, names) -> list:
  """What a checkpoint step of a run holds of parameters `names`: everything without LoRA;
  with LoRA the trained ones (adapters, trained biases), plus the frozen base with
  save_lora_base, or only the merged base with merge_lora."""
  peft = settings(cfg)
  if peft is None:
    return list(names)
  if peft.merge_lora:
    return [n for n in names if not is_adapter(n)]
  trained = set(trainable(cfg, names))
  return [n for n in names if n in trained or peft.save_lora_base]


def checkpoint_kind(cfg) -> str:
  """metadata.json's `lora.stored`: 'adapters', 'adapters+base' or 'merged'."""
  peft = settings(cfg)
  return 'merged' if peft.merge_lora else 'adapters+base' if peft.save_lora_base else 'adapters'
