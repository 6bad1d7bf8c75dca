"""Which linears LoRA adapts, and with what rank and alpha: the model_alignment_strategy.peft
settings read by peft's own rules on the HF module path (`model.layers.3.self_attn.q_proj`):
`target_modules` (names matched as path suffixes, NxD's fused names, `all-linear`, or one
regular expression matched against the whole path), `layers_to_transform`, and
`rank_pattern` / `alpha_pattern` ((pattern, value) pairs, the first whose pattern matches
the end of the path wins). alpha, rsLoRA, dropout and bias left unset (None) mean "the
loaded adapter's" (configs/from_files.py resolves them), else `DEFAULTS`. This is the config
side of LoRA, kept apart from model/lora.py's adapter math so that validating, exporting
(model/adapters.py) and matching a loaded adapter's plan (configs/from_files.py) read the
rules without the forward pass.
"""
import re

from config_checks import one_of, positive
from model import lora_fused

# NxD Training's fused names and peft's per-projection names, and what each covers.
TARGET_GROUPS = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'gate_up_proj': ('gate_proj', 'up_proj'),
                 'all-linear': ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')}
MODULES = TARGET_GROUPS['all-linear']
# latent attention's own projections (DeepSeek-V3, model/mla.py), under their HF names
LATENT = ('q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj')
PROJECTIONS = MODULES + LATENT         # every name a target may end in
BIASES = ('none', 'all', 'lora_only')
# What an unset (None) setting means when no loaded adapter supplies it.
DEFAULTS = {'lora_alpha': 16.0, 'use_rslora': False, 'lora_dropout': 0.0, 'lora_bias': 'none',
            'target_modules': ('qkv_proj',)}


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
  return isinstance(t, str) and t not in TARGET_GROUPS and t not in PROJECTIONS


def target_modules(peft) -> tuple:
  """The projections (q_proj, ..., down_proj, latent attention's) the adapters may target, in model order;
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
      if module not in PROJECTIONS:
        valid = ', '.join(list(TARGET_GROUPS) + list(PROJECTIONS))
        raise ValueError(f'model_alignment_strategy.peft.target_modules: {name!r} is unknown; valid: {valid} '
                         '(or a module path ending in one, or a regular expression)')
      if module not in out:
        out.append(module)
  return tuple(m for m in PROJECTIONS if m in out)


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
  if problems or model is None:
    return problems
  return fused_problems(peft, model) + latent_problems(peft, model)


def latent_problems(peft, model) -> list:
  """Latent attention (DeepSeek-V3) has no k or v projection (nor q with a q bottleneck): a
  target naming one would adapt nothing; its own projections (LATENT) are targets."""
  mla = model.get('mla')
  if mla is None or mla.get('kv_lora_rank', 0) <= 0 or is_regex(peft):
    return []
  entries = _target_entries(peft)
  absent = {'qkv_proj', 'k_proj', 'v_proj'} | ({'q_proj'} if mla.get('q_lora_rank') else set())
  named = sorted(absent & {str(t).split('.')[-1] for t in entries})
  if named:
    return [f'model_alignment_strategy.peft.target_modules={tuple(entries)!r} with latent attention '
            f'(model.mla): it has no {", ".join(named)}; its projections are '
            f'{", ".join(LATENT if mla.get("q_lora_rank") else ("q_proj",) + LATENT[2:])} and o_proj']
  return []


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
  if proj not in PROJECTIONS + lora_fused.ALL_LINEAR or '.mlp.shared_expert.' in module + '.':
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
