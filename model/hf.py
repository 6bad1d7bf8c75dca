"""Hugging Face models (model/hf_config.py's FAMILIES) <-> flatron: safetensors import/export (the
config.json mapping is model/hf_config.py, and model/hf_export.py the other way).

Our parameter names are HF's minus the leading `model.`, and the weights share HF's [out, in]
layout and rotate-half RoPE, so conversion is a rename plus (un)padding of the vocabulary
rows. Gemma's (1 + w) norms are stored as HF stores them (w). MoE experts are stacked per
projection ([E, f, h] gate_proj and up_proj, [E, h, f] down_proj); files hold them per expert as
save_pretrained writes them (Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen2-MoE's
mlp.experts.N.gate/up/down_proj): import stacks, export splits, both exact. A file holding the
stacks as transformers 5 holds them in memory ([E, 2f, h] gate_up_proj) is read too. Phi-3's fused
qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows) are our q/k/v and gate/up
projections' rows: import reads each one's rows, export concatenates them. Which HF tensor
holds each of ours: model/hf_names.py.
"""
import json
import os
import re

import torch
from safetensors.torch import save_file

from model import defaults, hf_gpt_oss, moe, param_table
from model.hf_files import HFFileError, open_safetensors, read_json
from model.hf_config import FAMILIES, GEMMA_KEYS, MOE_FAMILIES, config_from_hf  # pylint: disable=unused-import
from model.hf_export import config_to_hf  # pylint: disable=unused-import
from model.hf_names import family, few, file_name, fused_expert_stack, fused_rows, ignored, layout, to_hf_name, transposed_stack  # pylint: disable=unused-import

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
SHARD_PATTERN = re.compile(r'model-\d{5}-of-\d{5}\.safetensors')
VOCAB_PARAMS = ('embed_tokens.weight', 'lm_head.weight')


# --- load --------------------------------------------------------------------------------


def _weight_map(path):
  """(HF tensor name -> safetensors file holding it, the file to name in errors)."""
  single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
  if os.path.isfile(single):
    with open_safetensors(single) as f:
      return {name: single for name in f.keys()}, single
  if os.path.isfile(index):
    shards = read_json(index).get('weight_map')
    if not isinstance(shards, dict):
      raise HFFileError(f'{index}: no "weight_map" (tensor name -> shard file); re-save the model')
    files = {name: os.path.join(path, shard) for name, shard in shards.items()}
    absent = sorted({file for file in files.values() if not os.path.isfile(file)})
    if absent:
      raise FileNotFoundError(f'{index} lists shard files that do not exist: {few(absent)}')
    return files, index
  others = [n for n in ('pytorch_model.bin', 'pytorch_model.bin.index.json') if os.path.exists(os.path.join(path, n))]
  hint = f' (found {", ".join(others)}: re-save it with safe_serialization=True)' if others else ''
  raise FileNotFoundError(f'{path}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found{hint}')


def read_config(path, base_model=None):
  """The model section for an HF `config.json` (or a directory holding one); `base_model`
  supplies the keys HF does not set (default: model/defaults.py's model section)."""
  if base_model is None:
    base_model = defaults.model_section()
  config_path = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f'{config_path} not found (an HF model directory needs one)')
  hf_config = read_json(config_path)
  try:
    return config_from_hf(hf_config, base_model)
  except KeyError as e:
    raise HFFileError(f'{config_path}: no {e} (a key the model needs); is this the model\'s config.json?') from None
  except (ValueError, TypeError) as e:           # TypeError: a value of the wrong type
    raise HFFileError(f'{config_path}: {str(e).splitlines()[0]}') from None


def _checked_names(path, model_cfg):
  """(our name -> [[(file, HF name), ...] per expert]) for every parameter, after checking
  names and shapes."""
  specs = param_table.param_specs(model_cfg, adapters=False)
  files, source = _weight_map(path)
  _check_quantization(path, model_cfg)
  renamed = (lambda n: hf_gpt_oss.is_renamed(n)) if family(model_cfg) == 'gpt_oss' else (lambda n: False)
  layouts = {name: [hf_gpt_oss.hf_names(name, hf_gpt_oss.quantized(files))] if renamed(name)
             else layout(name, model_cfg, files) for name in specs}
  wanted = {hf_name for pieces in layouts.values() for piece in pieces for hf_name in piece}
  stored = {n for n in files if not ignored(n, model_cfg)}
  missing = sorted(wanted - stored)
  if missing:
    raise HFFileError(f'{source}: missing tensors {few(missing)}')
  unexpected = sorted(stored - wanted)
  if unexpected:
    raise HFFileError(f'{source}: unexpected tensors {few(unexpected)}')
  for name, pieces in layouts.items():
    if renamed(name):
      for hf_name in pieces[0]:
        _check_shape(files[hf_name], hf_name, hf_gpt_oss.expected_shape(hf_name, model_cfg))
      continue
    shape = specs[name].shape
    expected = (model_cfg.vocab_size,) + shape[1:] if name in VOCAB_PARAMS else shape
    if fused_rows(name, model_cfg):                     # Phi-3's [q; k; v] or [gate; up]
      expected = (fused_rows(name, model_cfg)[2],) + shape[1:]
    elif transposed_stack(name, model_cfg):             # Llama 4's [E, h, 2f] and [E, f, h]
      half = transposed_stack(name, model_cfg)[1]
      expected = (shape[0], shape[2], 2 * shape[1]) if half is not None else (shape[0], shape[2], shape[1])
    elif pieces[0][0].endswith('.gate_up_proj'):         # transformers 5's [E, 2f, h]
      expected = (shape[0], 2 * shape[1]) + shape[2:]
    elif moe.is_expert_param(name) and to_hf_name(name) not in files:    # one tensor per expert
      expected = shape[1:]
    for piece in pieces:
      for hf_name in piece:
        _check_shape(files[hf_name], hf_name, expected)
  return {name: [[(files[n], n) for n in piece] for piece in pieces] for name, pieces in layouts.items()}


def _check_quantization(path, model_cfg):
  """Quantized weights are read where flatron knows the format (gpt-oss's MXFP4), else refused."""
  config_path = os.path.join(path, CONFIG_FILE)
  quant = (read_json(config_path).get('quantization_config') or {}) if os.path.isfile(config_path) else {}
  method = quant.get('quant_method')
  if method and not (method == 'mxfp4' and family(model_cfg) == 'gpt_oss'):
    raise HFFileError(f'{config_path}: quantization_config.quant_method={method!r}: these weights are quantized and '
                      'flatron reads only unquantized files (and gpt-oss\'s MXFP4); dequantize them first (e.g. '
                      'transformers\' from_pretrained, then save_pretrained in bf16)')


def _check_shape(file, hf_name, expected):
  with open_safetensors(file) as f:
    found = tuple(f.get_slice(hf_name).get_shape())
  if found != tuple(expected):
    raise HFFileError(f'{file}: tensor {hf_name} has shape {found}, expected {tuple(expected)}')


def _read(file, hf_name, box=None):
  with open_safetensors(file) as f:
    try:
      part = f.get_slice(hf_name)
      return part[tuple(box)] if box is not None else part[:]
    except Exception as e:  # pylint: disable=broad-except   (safetensors' own error types)
      raise HFFileError(f'{file}: tensor {hf_name} could not be read ({str(e).splitlines()[0][:160]}); the file may '
                        'be cut short: download or copy it again') from None


def read_boxes(path, model_cfg, requests, dtype=torch.float32):
  """{name: box} -> {name: tensor}: only these boxes are read from the safetensors files (each
  rank of a parallel layout reads its own part, never the whole model; under expert
  parallelism its experts). Boxes of vocab tables must lie within the unpadded vocabulary."""
  where = _checked_names(path, model_cfg)
  out = {}
  for name, box in requests.items():
    pieces, fused = where[name], fused_rows(name, model_cfg)
    if family(model_cfg) == 'gpt_oss' and hf_gpt_oss.is_renamed(name):
      stored = dict((n, f) for f, n in pieces[0])
      tensor = hf_gpt_oss.read(name, box, lambda n, b: _read(stored[n], n, b),
                               any(n.endswith('_blocks') for n in stored)).contiguous()
    elif transposed_stack(name, model_cfg):      # Llama 4: read transposed (gate / up: this half's columns)
      half, f = transposed_stack(name, model_cfg)[1], param_table.param_specs(model_cfg, adapters=False)[name].shape[1]
      cols = box[1] if half is None else slice(box[1].start + half * f, box[1].stop + half * f)
      tensor = _read(*pieces[0][0], (box[0], box[2], cols)).transpose(1, 2).contiguous()
    elif fused:                  # this weight's rows of Phi-3's fused tensor
      rows = slice(box[0].start + fused[1], box[0].stop + fused[1])
      tensor = _read(*pieces[0][0], (rows,) + tuple(box[1:]))
    elif pieces[0][0][1].endswith('.gate_up_proj'):
      half, f = fused_expert_stack(name)[1], param_table.param_specs(model_cfg, adapters=False)[name].shape[1]
      rows = slice(box[1].start + half * f, box[1].stop + half * f)     # this half's rows of gate_up_proj
      tensor = _read(*pieces[0][0], (box[0], rows) + tuple(box[2:]))
    elif len(pieces) == 1 and len(pieces[0]) == 1:
      tensor = _read(*pieces[0][0], box)
    else:           # stacked experts from per-expert tensors: read this box's experts
      experts = range(box[0].start, box[0].stop)
      tensor = torch.stack([torch.cat([_read(*p) for p in pieces[e]])[tuple(box[1:])] for e in experts])
    out[name] = tensor if dtype is None else tensor.to(dtype)
  return out


def load_hf(path, base_model=None, dtype=torch.float32):
  """(model config section, params) from an HF model directory; vocab rows zero-padded as ours.

  `base_model` supplies the keys HF does not set (see config_from_hf; default: model/defaults.py's
  model section). dtype=None keeps each tensor's stored dtype.
  """
  model_cfg = read_config(path, base_model)
  specs = param_table.param_specs(model_cfg, adapters=False)
  whole = {name: tuple(slice(0, n) for n in ((model_cfg.vocab_size,) + spec.shape[1:]
                                             if name in VOCAB_PARAMS else spec.shape))
           for name, spec in specs.items()}
  loaded = read_boxes(path, model_cfg, whole, dtype)
  for name in VOCAB_PARAMS:
    if name in loaded:
      padded = loaded[name].new_zeros(specs[name].shape)   # padded rows are never a label
      padded[:model_cfg.vocab_size] = loaded[name]
      loaded[name] = padded
  return model_cfg, {name: loaded[name] for name in specs}


# --- save --------------------------------------------------------------------------------


def _check_params(model_cfg, params, specs):
  missing, unexpected = [n for n in specs if n not in params], [n for n in params if n not in specs]
  if missing or unexpected:
    raise ValueError(f'params do not match the config: missing {few(missing) or "none"}, '
                     f'unexpected {few(unexpected) or "none"}')
  for name, spec in specs.items():
    found = tuple(params[name].shape)
    # Vocab tables may be padded for any TP degree; only the first vocab_size rows are real.
    ok = (found[1:] == spec.shape[1:] and found[0] >= model_cfg.vocab_size) if name in VOCAB_PARAMS \
        else found == spec.shape
    if not ok:
      raise ValueError(f'param {name} has shape {found}, expected {spec.shape}')


def _shards(tensors, max_shard_bytes):
  """Consecutive groups of tensors, each under max_shard_bytes unless a single tensor exceeds it."""
  shards, size = [{}], 0
  for name, tensor in tensors.items():
    nbytes = tensor.numel() * tensor.element_size()
    if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensor
    size += nbytes
  return shards


def _remove_old_weights(path):
  """A stale single file or shard set beside the new one would make loaders pick the wrong one."""
  for name in os.listdir(path):
    if name in (WEIGHTS_FILE, INDEX_FILE) or SHARD_PATTERN.fullmatch(name):
      os.remove(os.path.join(path, name))


def transposed_stack_name(hf_name):
  return hf_name.endswith(('.feed_forward.experts.gate_up_proj', '.feed_forward.experts.down_proj'))


def save_hf(path, model_cfg, params, max_shard_bytes=None):
  """Write an HF model directory (config.json + safetensors, sharded past max_shard_bytes)."""
  hf_config = config_to_hf(model_cfg)
  specs = param_table.param_specs(model_cfg, adapters=False)
  _check_params(model_cfg, params, specs)
  tensors, fused = {}, {}
  gpt_oss = family(model_cfg) == 'gpt_oss'
  for name in specs:
    if gpt_oss and hf_gpt_oss.is_renamed(name):
      if name.endswith('.mlp.gate.weight'):       # the layer's renamed tensors, all at once
        layer = name.split('.mlp.')[0]
        tensors.update(hf_gpt_oss.to_hf({n: t.detach().to('cpu') for n, t in params.items()
                                         if n.startswith(layer + '.mlp.')}, layer))
      continue
    tensor = params[name].detach().to('cpu')
    if name in VOCAB_PARAMS:
      tensor = tensor[:model_cfg.vocab_size]
    pieces = layout(name, model_cfg, ())
    if fused_rows(name, model_cfg):       # Phi-3: concatenated below, in row order
      fused.setdefault(pieces[0][0], []).append((fused_rows(name, model_cfg)[1], tensor))
      continue
    if transposed_stack(name, model_cfg):   # Llama 4: [E, h, 2f] (gate, then up) and [E, f, h]
      fused.setdefault(pieces[0][0], []).append((transposed_stack(name, model_cfg)[1] or 0, tensor.transpose(1, 2)))
      continue
    if len(pieces) == 1:
      tensors[pieces[0][0]] = tensor.contiguous()
      continue
    for e, piece in enumerate(pieces):     # as save_pretrained writes experts: one tensor each
      for hf_name, part in zip(piece, tensor[e].chunk(len(piece))):
        tensors[hf_name] = part.clone()
  for hf_name, parts in fused.items():     # Phi-3's rows; Llama 4's transposed experts, gate and up side by side
    dim = -1 if transposed_stack_name(hf_name) else 0
    tensors[hf_name] = torch.cat([t for _, t in sorted(parts, key=lambda part: part[0])], dim=dim).contiguous()
  dtype_name = str(params['embed_tokens.weight'].dtype).removeprefix('torch.')
  hf_config['torch_dtype'] = hf_config['dtype'] = dtype_name   # 4.x reads torch_dtype, 5.x dtype

  os.makedirs(path, exist_ok=True)
  _remove_old_weights(path)
  shards = _shards(tensors, max_shard_bytes)
  if len(shards) == 1:
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={'format': 'pt'})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
      save_file(shard, os.path.join(path, file), metadata={'format': 'pt'})
      weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  with open(os.path.join(path, CONFIG_FILE), 'w') as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)


TOKEN_ID_KEYS = ('bos_token_id', 'eos_token_id', 'pad_token_id')
GENERATION_FILE = 'generation_config.json'


def token_ids(path) -> dict:
  """The special token ids an HF directory's config.json names (those it sets)."""
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    return {}
  config = read_json(config_path)
  return {k: config[k] for k in TOKEN_ID_KEYS if config.get(k) is not None}


def write_generation_files(path, ids, generation_config=None):
  """Put special token ids `ids` into the config.json at `path`, and write generation_config.json:
  `generation_config` (a dict, as it is) or one made from the ids, so transformers' generate
  stops at end-of-text."""
  config_path = os.path.join(path, CONFIG_FILE)
  with open(config_path) as f:
    config = json.load(f)
  config.update({k: v for k, v in ids.items() if v is not None})
  with open(config_path, 'w') as f:
    json.dump(config, f, indent=2, sort_keys=True)
  generation = dict(generation_config) if generation_config else {
      '_from_model_config': True, **{k: v for k, v in ids.items() if v is not None}}
  with open(os.path.join(path, GENERATION_FILE), 'w') as f:
    json.dump(generation, f, indent=2, sort_keys=True)


def is_hf_dir(path) -> bool:
  """Whether `path` (a local directory) holds an HF model's config.json."""
  return os.path.isfile(os.path.join(path, CONFIG_FILE))
