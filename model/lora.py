"""LoRA (Hu et al. 2021) exactly as peft computes it, on the flat parameter dict.

A targeted linear `W` (name `<prefix>.<module>.weight`, [out, in]) gets two parameters named
as peft names them, `<prefix>.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]:

    y = W x + b + scaling * B (A dropout(x)),   scaling = alpha / r  (alpha / sqrt(r): rsLoRA)

A starts as peft's kaiming-uniform (uniform in +-1/sqrt(in)), B at zero, so step 0 is the base
model. The base is frozen; adapters are fp32 parameters whatever the recipe (the base may be
bf16) and compute in the activations' dtype. Settings come from `cfg.peft`, the
model_alignment_strategy.peft section. Which linears are adapted, and each one's r and alpha,
follow peft's own rules on the HF module path (`model.layers.3.self_attn.q_proj`):
`target_modules` (names matched as path suffixes, NxD's fused names, `all-linear`, or one
regular expression matched against the whole path), `layers_to_transform`, and
`rank_pattern` / `alpha_pattern` ((pattern, value) pairs, the first whose pattern matches
the end of the path wins). alpha, rsLoRA, dropout and bias left unset (None) mean "the
loaded adapter's" (configs/from_files.py resolves them), else `DEFAULTS`.

Nothing here knows about parallelism: parallel/tensor.py decides which box of A and B a rank
holds (Megatron's way: A replicated and B split for column-parallel targets, A split and B
replicated for row-parallel ones) and the adapter's partial output of a row-parallel target
joins the base layer's own reduction (`layers.linear`). A's rows are never split, so a
linear's rank is the first dimension of its A. Phi-3's fused modules share one A among their
projections (model/lora_fused.py).
"""
import math
import os
import re

import torch
import torch.nn.functional as F

from config_checks import one_of, positive
from model import lora_fused

# NxD Training's fused names and peft's per-projection names, and what each covers.
TARGET_GROUPS = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'gate_up_proj': ('gate_proj', 'up_proj'),
                 'all-linear': ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')}
MODULES = TARGET_GROUPS['all-linear']
BIASES = ('none', 'all', 'lora_only')
FACTORS = ('lora_A', 'lora_B')
# What an unset (None) setting means when no loaded adapter supplies it.
DEFAULTS = {'lora_alpha': 16.0, 'use_rslora': False, 'lora_dropout': 0.0, 'lora_bias': 'none',
            'target_modules': ('qkv_proj',)}


def adapter_source(peft) -> str:
  """Where load_lora_from_ckpt reads the starting adapter: lora_save_dir/lora_load_tag."""
  return os.path.join(peft.lora_save_dir, peft.lora_load_tag or '')


def settings(cfg):
  """The peft section of model config `cfg`, or None when LoRA is off."""
  peft = cfg.get('peft') if hasattr(cfg, 'get') else None
  return peft if peft is not None and peft.get('lora_rank', 0) > 0 else None


def option(peft, key):
  """peft.<key>, or its default when unset (None or absent): DEFAULTS', else ()."""
  value = peft.get(key) if hasattr(peft, 'get') else getattr(peft, key, None)
  return DEFAULTS.get(key, ()) if value is None else value


def _target_entries(peft) -> tuple:
  t = option(peft, 'target_modules')
  return (t,) if isinstance(t, str) else tuple(t)


def is_regex(peft) -> bool:
  """peft reads a target_modules string that names no module as a regular expression."""
  t = option(peft, 'target_modules')
  return isinstance(t, str) and t not in TARGET_GROUPS and t not in MODULES


def target_modules(peft) -> tuple:
  """The projections (q_proj, ..., down_proj) the adapters may target, in model order;
  unknown names raise. Entries may be NxD's fused names, peft's names, or module paths
  ending in one; a regular expression may target any."""
  if is_regex(peft):
    try:
      re.compile(option(peft, 'target_modules'))
    except re.error as e:
      raise ValueError(f'model_alignment_strategy.peft.target_modules: {option(peft, "target_modules")!r} is '
                       f'neither a module name nor a valid regular expression ({e})') from None
    return MODULES
  if not all(isinstance(t, str) for t in _target_entries(peft)):
    raise ValueError(f'model_alignment_strategy.peft.target_modules={option(peft, "target_modules")!r}: give '
                     "module names, e.g. ('q_proj', 'v_proj'), or one regular expression as a string")
  out = []
  for name in _target_entries(peft):
    last = name.rsplit('.', 1)[-1]
    expanded = TARGET_GROUPS.get(name, TARGET_GROUPS.get(last, (last,)))
    for module in expanded:
      if module not in MODULES:
        valid = ', '.join(list(TARGET_GROUPS) + list(MODULES))
        raise ValueError(f'model_alignment_strategy.peft.target_modules: {name!r} is unknown; valid: {valid} '
                         '(or a module path ending in one, or a regular expression)')
      if module not in out:
        out.append(module)
  return tuple(m for m in MODULES if m in out)


def check(peft, model=None) -> list:
  """Problems with model_alignment_strategy.peft (for model section `model`, when given); nothing
  to check while lora_rank is 0."""
  key = 'model_alignment_strategy.peft'
  problems = []
  positive(problems, f'{key}.lora_rank', peft.lora_rank, allow_zero=True)
  if peft.lora_rank <= 0:
    return problems
  positive(problems, f'{key}.lora_alpha', option(peft, 'lora_alpha'))
  dropout = option(peft, 'lora_dropout')
  if not 0.0 <= dropout < 1.0:
    problems.append(f'{key}.lora_dropout={dropout} must be in [0, 1)')
  one_of(problems, f'{key}.lora_bias', option(peft, 'lora_bias'), BIASES)
  try:
    if not target_modules(peft):
      problems.append(f'{key}.target_modules is empty; name the projections to adapt, e.g. (\'qkv_proj\',)')
  except ValueError as e:
    problems.append(str(e))
  for name in ('rank_pattern', 'alpha_pattern'):
    for pair in option(peft, name):
      if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[1], (int, float)) or pair[1] <= 0:
        problems.append(f'{key}.{name}: {pair!r} is not a (pattern, positive number) pair, e.g. (\'q_proj\', 8)')
        continue
      try:
        re.compile(str(pair[0]))
      except re.error as e:
        problems.append(f'{key}.{name}: {pair[0]!r} is not a valid regular expression ({e})')
  if peft.merge_lora and peft.save_lora_base:
    problems.append(f'{key}: merge_lora and save_lora_base both set; a merged checkpoint already holds '
                    'the whole model, choose one')
  if peft.load_lora_from_ckpt and not peft.lora_save_dir:
    problems.append(f'{key}.load_lora_from_ckpt needs lora_save_dir (a flatron step or peft directory, '
                    'with lora_load_tag its sub-directory)')
  return problems if problems or model is None else fused_problems(peft, model)


def fused_problems(peft, model) -> list:
  """What peft could not hold on model section `model`'s fused modules (Phi-3's; none elsewhere)."""
  if not lora_fused.is_fused(model):
    return []
  out = [] if is_regex(peft) else lora_fused.target_problems(_target_entries(peft))
  for key, default in (('rank_pattern', peft.lora_rank), ('alpha_pattern', option(peft, 'lora_alpha'))):
    out += lora_fused.pattern_problems(model, key, lambda path, key=key: _pattern_value(option(peft, key), path),
                                       default)
  return out


def module_path(linear) -> str:
  """'layers.3.self_attn.q_proj' -> peft's key of that module in a Llama, 'model.layers.3.self_attn.q_proj'."""
  return 'model.' + linear


def is_target(peft, module) -> bool:
  """Whether module `module` ('layers.3.self_attn.q_proj', or Phi-3's fused 'layers.3.self_attn.qkv_proj')
  gets an adapter, by peft's rules."""
  path, proj = module_path(module), module.rsplit('.', 1)[-1]
  if proj not in MODULES + lora_fused.ALL_LINEAR or '.mlp.shared_expert.' in module + '.':
    return False      # MoE layers (model/moe.py) take no adapters: their experts stay frozen
  if is_regex(peft):        # peft applies layers_to_transform to listed names only, not to a regex
    return re.fullmatch(option(peft, 'target_modules'), path) is not None
  hit = any(path == t or path.endswith('.' + t) or proj in TARGET_GROUPS.get(t, ()) or t == 'all-linear'
            for t in _target_entries(peft))
  layers = option(peft, 'layers_to_transform')
  layers = (layers,) if isinstance(layers, int) else tuple(layers)
  return hit and (not layers or int(module.split('.')[1]) in layers)


def _pattern_value(pairs, path):
  """peft's get_pattern_key: the value of the first pattern matching the end of `path`."""
  for pattern, value in (pairs.items() if hasattr(pairs, 'items') else pairs):
    if re.match(rf'(.*\.)?({pattern})$', path):
      return value
  return None


def rank_of(peft, linear) -> int:
  r = _pattern_value(option(peft, 'rank_pattern'), module_path(linear))
  return int(peft.lora_rank if r is None else r)


def alpha_of(peft, linear) -> float:
  alpha = _pattern_value(option(peft, 'alpha_pattern'), module_path(linear))
  return float(option(peft, 'lora_alpha') if alpha is None else alpha)


def scaling(peft, linear, rank) -> float:
  """alpha / r (alpha / sqrt(r) with rsLoRA) of `linear`, whose adapter has rank `rank`
  (the first dimension of its A: never split)."""
  return alpha_of(peft, linear) / (math.sqrt(rank) if option(peft, 'use_rslora') else rank)


def plan(cfg, names) -> dict:
  """linear -> (rank, alpha) of every adapted linear among weight names `names` (those of
  Phi-3's fused module: the module's)."""
  peft = settings(cfg)
  if peft is None:
    return {}
  problems = fused_problems(peft, cfg)
  if problems:
    raise ValueError('\n'.join(problems))
  linears = [n[:-len('.weight')] for n in names if n.startswith('layers.') and n.endswith('.weight')]
  modules = {lin: lora_fused.module_of(cfg, lin) for lin in linears}
  return {lin: (rank_of(peft, m), alpha_of(peft, m)) for lin, m in modules.items() if is_target(peft, m)}


def split_name(name):
  """'layers.0.self_attn.q_proj.lora_A.weight' -> ('layers.0.self_attn.q_proj', 'lora_A'); else None."""
  parts = name.split('.')
  if len(parts) >= 3 and parts[-2] in FACTORS:
    return '.'.join(parts[:-2]), parts[-2]
  return None


def is_adapter(name) -> bool:
  return split_name(name) is not None


# Megatron's split of a factor pair by its base layer's layout: a column layer's B is split like
# its weight and A replicated, a row layer's A like its weight and B replicated. A replicated
# factor sees only this rank's shard of the layer: its gradient is partial over TP.
FACTOR_LAYOUTS = {'column': ('tp_partial', 'column'), 'column_kv': ('tp_partial', 'column_kv'),
                  'row': ('row', 'tp_partial')}


def adapter_specs(cfg, base_specs, spec_type) -> dict:
  """name -> spec of every adapter factor, for the targeted linear weights in `base_specs`: A
  named after the module (one for Phi-3's fused projections: the same input, rank and layout),
  B after the linear."""
  out = {}
  for linear, (rank, _) in plan(cfg, base_specs).items():
    base = base_specs[linear + '.weight']
    out_dim, in_dim = base.shape
    a, b = FACTOR_LAYOUTS[base.layout]
    out[f'{lora_fused.module_of(cfg, linear)}.lora_A.weight'] = spec_type(
        (rank, in_dim), 'uniform', 1.0 / math.sqrt(in_dim), layout=a)
    out[f'{linear}.lora_B.weight'] = spec_type((out_dim, rank), 'zeros', layout=b)
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
    elif n.endswith('.bias') and (option(peft, 'lora_bias') == 'all' or
                                  (option(peft, 'lora_bias') == 'lora_only' and n[:-len('.bias')] in adapted)):
      keep.append(n)
  return keep


def delta(params, linear, x, cfg, dropout, first_linear=F.linear):
  """The adapter's contribution to `linear`'s output for input `x` (None if not adapted):
  scaling * B (A dropout(x)), in x's dtype. `dropout(x, p, site)` applies the keyed dropout of
  module `site` (Phi-3's q, k and v draw their fused qkv_proj's one mask); `first_linear` runs A
  (the base layer's own linear, so that under SP A keeps what it keeps)."""
  b = params.get(linear + '.lora_B.weight')
  if b is None:
    return None
  module, peft = lora_fused.module_of(cfg, linear), cfg.peft
  a = params[module + '.lora_A.weight']
  x = dropout(x, option(peft, 'lora_dropout'), module.rsplit('.', 1)[-1])
  return F.linear(first_linear(x, a.to(x.dtype)), b.to(x.dtype)) * scaling(peft, module, rank=a.shape[0])


def merged(params, cfg) -> dict:
  """Base weights with every adapter folded in (W + scaling B A), without the adapter
  factors: the full model that equals base + adapters (needs whole, unsharded tensors)."""
  peft = settings(cfg)
  out = {n: p for n, p in params.items() if not is_adapter(n)}
  if peft is None:
    return out
  for name in params:
    split = split_name(name)
    if split and split[1] == 'lora_B':
      module = lora_fused.module_of(cfg, split[0])
      w, a = params[split[0] + '.weight'], params[module + '.lora_A.weight']
      product = params[name].double() @ a.double()
      s = scaling(peft, module, rank=a.shape[0])
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
