"""Hugging Face models (model/hf_config.py's FAMILIES) <-> flatron: safetensors import here, export
in model/hf_save.py (the config.json mapping is model/hf_config.py, and model/hf_export.py the
other way).

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
import os

import torch

from model import defaults, hf_gpt_oss, moe, param_table
from model.hf_config import FAMILIES, GEMMA_KEYS, MOE_FAMILIES, config_from_hf  # pylint: disable=unused-import
from model.hf_export import config_to_hf  # pylint: disable=unused-import
from model.hf_files import CONFIG_FILE, INDEX_FILE, VOCAB_PARAMS, WEIGHTS_FILE, HFFileError, open_safetensors, read_json
from model.hf_names import family, few, file_name, fused_expert_stack, fused_rows, ignored, layout, to_hf_name, transposed_stack  # pylint: disable=unused-import
# the writing side, here for the callers of model.hf
from model.hf_save import GENERATION_FILE, TOKEN_ID_KEYS, is_hf_dir, save_hf, token_ids, write_generation_files  # pylint: disable=unused-import



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
