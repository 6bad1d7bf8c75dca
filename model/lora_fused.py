"""LoRA on Phi-3's fused modules, as peft computes it.

Phi-3's HF modules `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up] rows) are our
separate projections (model/hf_names.py). peft adapts each fused module as one linear: one A [r, in]
and one B [rows, r], so q, k and v (gate and up) read the same A dropout(x), with one dropout
mask and one r and alpha per fused module. Here that A is one parameter named after the fused
module, `layers.3.self_attn.qkv_proj.lora_A.weight`, laid out like a column layer's A (whole on
every TP rank, its gradient the sum of its uses, partial over TP), and B is kept per projection,
`layers.3.self_attn.q_proj.lora_B.weight` ..., split like its base's rows; a peft file's B is
their rows concatenated (model/adapters.py). Elsewhere a module is the linear itself and NxD's
`qkv_proj` keeps naming q, k and v, each with its own adapter.

peft matches target_modules and rank / alpha patterns against Phi-3's module paths: a target
naming a projection inside a fused module adapts nothing there, and a pattern keyed by one
would give that projection its own r or alpha, which one A cannot hold; both are refused.
"""
FUSED = {'q_proj': 'qkv_proj', 'k_proj': 'qkv_proj', 'v_proj': 'qkv_proj',
         'gate_proj': 'gate_up_proj', 'up_proj': 'gate_up_proj'}
# peft's all-linear on a Phi-3 (every nn.Linear of its layers), as it writes target_modules
ALL_LINEAR = ('qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj')
SITES = {'qkv_proj': 'self_attn', 'gate_up_proj': 'mlp'}


def is_fused(cfg) -> bool:
  """Whether model section `cfg` is HF Phi-3, whose files fuse q, k, v and gate, up (model/hf_names.py
  `fused_rows` reads them by this rule): the one family that rotates part of each head."""
  return cfg.get('architecture') == 'phi3' or cfg.get('rotary_percentage', 1.0) != 1.0


def module_of(cfg, linear) -> str:
  """peft's module holding linear `linear` ('layers.3.self_attn.k_proj'): Phi-3's fused module
  ('layers.3.self_attn.qkv_proj') for q, k, v, gate and up, else the linear itself."""
  prefix, _, proj = linear.rpartition('.')
  return f'{prefix}.{FUSED[proj]}' if proj in FUSED and is_fused(cfg) else linear


def factor_names(linear) -> tuple:
  """The adapter factors that may follow base weight `linear` in forward order: a fused module's
  shared A (before its first projection's B), then the linear's own A and B."""
  prefix, _, proj = linear.rpartition('.')
  shared = (f'{prefix}.{FUSED[proj]}.lora_A.weight',) if proj in FUSED else ()
  return shared + (f'{linear}.lora_A.weight', f'{linear}.lora_B.weight')


def target_problems(entries) -> list:
  """Phi-3 target_modules entries (names or module paths) naming a projection inside a fused
  module: peft finds no such module in a Phi-3."""
  out = []
  for name in entries:
    proj = name.rsplit('.', 1)[-1]
    if proj in FUSED:
      out.append(f'model_alignment_strategy.peft.target_modules: {name!r} is inside one of Phi-3\'s fused modules '
                 f'({FUSED[proj]}), which peft adapts whole with one A shared by its projections; target '
                 f'{FUSED[proj]!r} (or all-linear)')
  return out


def pattern_problems(cfg, key, value_of, default) -> list:
  """A rank or alpha pattern (`key`) that gives a projection of one of Phi-3's fused modules
  another value than the module gets: `value_of(path)` is the pattern's value at an HF module
  path (None where none matches), `default` the value then. peft reads the module's path only."""
  out, seen = [], set()
  for i in range(cfg.num_layers):
    for module, site in SITES.items():
      fused = f'model.layers.{i}.{site}.{module}'
      whole = value_of(fused)
      whole = default if whole is None else whole
      for proj in (p for p, m in FUSED.items() if m == module):
        own = value_of(f'model.layers.{i}.{site}.{proj}')
        if own is not None and own != whole and proj not in seen:      # the first layer says it
          seen.add(proj)
          out.append(f'model_alignment_strategy.peft.{key} gives model.layers.{i}.{site}.{proj} {own}, but its '
                     f'fused Phi-3 module {fused} {whole}: that module has one A for all its projections, so one '
                     f'{key.split("_")[0]}; key the pattern by {module}')
  return out
