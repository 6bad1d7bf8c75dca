"""LoRA adapters as peft writes them: `adapter_config.json` + `adapter_model.safetensors`.

A peft directory made here loads with `PeftModel.from_pretrained(llama, dir)`, and one made by
peft (for a Llama, target modules by name) loads here: its settings become
model_alignment_strategy.peft, its tensors the `lora_A` / `lora_B` parameters. Keys are peft's
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (our name with HF's
`model.` prefix, under peft's `base_model.model.`). A Phi-3 adapter's fused modules hold one A
(ours too: model/lora_fused.py) and one B, the rows of our per-projection Bs (model/hf_names.py's rows of
the fused weight).
"""
import json
import os

from ml_collections import config_dict
import torch
from safetensors.torch import save_file

from model import hf_files, hf_names, lora, lora_fused, lora_targets, moe, param_table

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'
PREFIX = 'base_model.model.'


def peft_key(name) -> str:
  return PREFIX + hf_names.to_hf_name(name)


def our_name(key) -> str:
  return hf_names.from_hf_name(key[len(PREFIX):] if key.startswith(PREFIX) else key)


def _fused_b(name, model_cfg):
  """(the fused B holding our B `name` under our naming, its first row there, its rows), or None:
  Phi-3's fused modules, whose B rows are those of the fused weight."""
  split = lora.split_name(name)
  if model_cfg is None or not split or split[1] != 'lora_B':
    return None
  fused = hf_names.fused_rows(split[0] + '.weight', model_cfg)
  return fused and (our_name(fused[0])[:-len('weight')] + 'lora_B.weight',) + fused[1:]


def is_peft_dir(path) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _peft_targets(peft, model_cfg):
  """target_modules as peft reads them: NxD's fused names written out (kept on Phi-3, whose
  modules they name, as is all-linear's list there), a regex kept as is."""
  targets = lora.option(peft, 'target_modules')
  if lora_targets.is_regex(peft):
    return targets
  entries = (targets,) if isinstance(targets, str) else tuple(targets)
  groups = {'all-linear': lora_fused.ALL_LINEAR} if lora_fused.is_fused(model_cfg) else lora_targets.TARGET_GROUPS
  out = []
  for name in entries:
    for t in groups.get(name, (name,)):
      if t not in out:
        out.append(t)
  return out


def _pairs(value) -> dict:
  return {str(k): v for k, v in (value.items() if hasattr(value, 'items') else value or ())}


def peft_config(peft, model_cfg, base_model_name_or_path=None) -> dict:
  """adapter_config.json for our settings (peft's LoraConfig fields) on model section `model_cfg`."""
  layers = peft.get('layers_to_transform') or None
  return {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'auto_mapping': None,
      'base_model_name_or_path': base_model_name_or_path, 'inference_mode': True,
      'r': int(peft.lora_rank), 'lora_alpha': lora.option(peft, 'lora_alpha'),
      'lora_dropout': lora.option(peft, 'lora_dropout'), 'use_rslora': bool(lora.option(peft, 'use_rslora')),
      'bias': lora.option(peft, 'lora_bias'), 'target_modules': _peft_targets(peft, model_cfg), 'fan_in_fan_out': False,
      'init_lora_weights': True, 'modules_to_save': None, 'use_dora': False, 'lora_bias': False,
      'layers_to_transform': list(layers) if layers else None, 'layers_pattern': None,
      'rank_pattern': {k: int(v) for k, v in _pairs(peft.get('rank_pattern')).items()},
      'alpha_pattern': {k: float(v) for k, v in _pairs(peft.get('alpha_pattern')).items()},
  }


def save_peft(path, model_cfg, params, base_model_name_or_path=None):
  """Write the adapters (and trained biases) of `params` (whole tensors) as a peft directory; adapters
  on a mixture-of-experts model's dense MLPs are refused (peft would not load them)."""
  peft = lora.settings(model_cfg)
  if peft is None:
    raise ValueError('the model has no LoRA adapters (model_alignment_strategy.peft.lora_rank is 0)')
  names = lora.trainable(model_cfg, params)
  mlp = [n for n in names if '.mlp.' in n and lora.is_adapter(n)]
  if moe.enabled(model_cfg) and mlp:
    few = hf_names.few(mlp, 2)
    raise ValueError(f'{few}: peft on transformers 5 reads the target_modules '
                     'gate_proj, up_proj and down_proj of a mixture-of-experts model as its experts\' '
                     '(target_parameters) and leaves the dense layers\' MLPs without adapters, so it would drop '
                     'these; export adapters on attention only (q_proj, k_proj, v_proj, o_proj), or merge them into '
                     'the model (tools.convert flatron-to-hf)')
  tensors, fused = {}, {}
  for n in names:
    tensor = params[n].detach().to('cpu', torch.float32)
    if _fused_b(n, model_cfg):           # Phi-3: concatenated below, in row order
      whole, first, _ = _fused_b(n, model_cfg)
      fused.setdefault(peft_key(whole), []).append((first, tensor))
    else:
      tensors[peft_key(n)] = tensor.contiguous()
  for key, parts in fused.items():
    tensors[key] = torch.cat([t for _, t in sorted(parts, key=lambda part: part[0])])
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={'format': 'pt'})
  with open(os.path.join(path, CONFIG_FILE), 'w') as f:
    json.dump(peft_config(peft, model_cfg, base_model_name_or_path), f, indent=2, sort_keys=True)


# adapter_config.json fields that change what the adapter computes and that flatron does not
# implement: refused by name when set (their value when unset).
UNSUPPORTED = {'use_dora': False, 'lora_bias': False, 'fan_in_fan_out': False, 'modules_to_save': None,
               'exclude_modules': None, 'layer_replication': None, 'target_parameters': None,
               'trainable_token_indices': None, 'use_qalora': False, 'alora_invocation_tokens': None,
               'arrow_config': None, 'use_bdlora': None}


def read_settings(path) -> dict:
  """model_alignment_strategy.peft values from a peft directory's adapter_config.json; every
  field that changes the adapter's math is honoured or refused by name."""
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f'{config_path} not found (a peft adapter directory needs one)')
  c = hf_files.read_json(config_path)
  unsupported = [f'peft_type={c.get("peft_type")!r}'] if c.get('peft_type', 'LORA') != 'LORA' else []
  unsupported += [f'{k}={c[k]!r}' for k, off in UNSUPPORTED.items() if c.get(k) not in (off, None, [], {}, False)]
  layers_pattern = c.get('layers_pattern')
  if layers_pattern not in (None, '', [], 'layers', ['layers']):
    unsupported.append(f'layers_pattern={layers_pattern!r} (a Llama\'s layers are model.layers.N)')
  if unsupported:
    raise hf_files.HFFileError(f'{config_path}: not supported here: {", ".join(unsupported)}; these change what the '
                     'adapter computes, so it cannot be loaded faithfully')
  targets = c.get('target_modules')
  if not targets:
    raise hf_files.HFFileError(f'{config_path}: target_modules is empty')
  layers = c.get('layers_to_transform')
  try:      # peft's defaults where a field is absent (r=8, lora_alpha=8)
    settings = _settings(c, targets, layers)
  except (TypeError, ValueError, AttributeError) as e:
    raise hf_files.HFFileError(f'{config_path}: a value of the wrong type ({e}); fix it or export the adapter '
                               'again') from None
  try:
    lora_targets.target_modules(config_dict.ConfigDict(settings))
  except ValueError as e:
    raise hf_files.HFFileError(f'{config_path}: {e}') from None
  return settings


def _settings(c, targets, layers):
  if not isinstance(targets, (str, list, tuple)) or not all(isinstance(t, str) for t in targets):
    raise TypeError(f'target_modules={targets!r}: a module name, a regex or a list of names')
  return {'lora_rank': int(c.get('r', 8)), 'lora_alpha': float(c.get('lora_alpha', 8)),
              'lora_dropout': float(c.get('lora_dropout') or 0.0), 'use_rslora': bool(c.get('use_rslora')),
              'lora_bias': c.get('bias') or 'none',
              'target_modules': targets if isinstance(targets, str) else tuple(targets),
              'layers_to_transform': (layers,) if isinstance(layers, int) else tuple(layers or ()),
              'rank_pattern': tuple((k, int(v)) for k, v in (c.get('rank_pattern') or {}).items()),
              'alpha_pattern': tuple((k, float(v)) for k, v in (c.get('alpha_pattern') or {}).items())}


def read_boxes(path, requests, model_cfg=None) -> dict:
  """name -> the requested box (tuple of slices) of each adapter tensor in a peft directory (a
  Phi-3 adapter's B: rows of its fused B, which needs the model section `model_cfg`)."""
  file = os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f'{file} not found (adapter_model.bin: re-save it with safe_serialization=True)')
  out = {}
  with hf_files.open_safetensors(file) as f:
    available = {our_name(k): k for k in f.keys()}
    where = {n: _fused_b(n, model_cfg) or (n, 0, None) for n in requests}     # (stored name, first row, rows)
    missing = sorted(n for n, (stored_name, _, _) in where.items() if stored_name not in available)
    if missing:
      raise hf_files.HFFileError(f'{file}: missing {", ".join(missing[:5])}{" ..." if len(missing) > 5 else ""} '
                       '(are target_modules the ones it was trained with?)')
    for name, box in requests.items():
      stored_name, first, rows = where[name]
      stored = f.get_slice(available[stored_name])
      shape = tuple(stored.get_shape())
      box = (slice(box[0].start + first, box[0].stop + first),) + tuple(box[1:])
      if len(box) != len(shape) or any(s.stop > n for s, n in zip(box, shape)) or rows not in (None, shape[0]):
        # slicing past the end would silently return less (a rank 4 tensor read as rank 8)
        raise hf_files.HFFileError(
            f'{file}: {available[stored_name]} has shape {list(shape)}, but adapter_config.json\'s settings and '
            f'the model need {[rows or s.stop for s in box[:1]] + [s.stop for s in box[1:]]} at least (is r the rank '
            'it was trained with, the model the one it was trained on?)')
      out[name] = stored[box]
  return out


def load_peft(path, model_cfg, params):
  """(model section with the adapter's LoRA settings, `params` plus its whole adapter
  tensors): a peft directory applied to a whole model of this process."""
  model_cfg = model_cfg.copy_and_resolve_references()
  model_cfg.peft = config_dict.ConfigDict(dict(model_cfg.peft.to_dict(), **read_settings(path)))
  specs = param_table.param_specs(model_cfg)
  wanted = {n: tuple(slice(0, k) for k in specs[n].shape) for n in lora.trainable(model_cfg, specs)}
  return model_cfg, dict(params, **read_boxes(path, wanted, model_cfg))
