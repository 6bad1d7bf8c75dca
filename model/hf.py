"""Hugging Face Llama <-> flatron: config translation and safetensors import/export.

Our parameter names are HF Llama's minus the leading `model.`, and the weights share HF's
[out, in] layout and rotate-half RoPE, so conversion is a rename plus (un)padding of the
vocabulary rows. Works with the config layouts of transformers 4.x (top-level `rope_theta`,
`rope_scaling`) and 5.x (`rope_parameters`).
"""
import copy
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import transformer

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
SHARD_PATTERN = re.compile(r'model-\d{5}-of-\d{5}\.safetensors')
VOCAB_PARAMS = ('embed_tokens.weight', 'lm_head.weight')
FAMILIES = ('llama', 'qwen2')     # HF model_type values imported here


# --- config -----------------------------------------------------------------------------


ROPE_TYPES = ('default', 'linear', 'llama3')   # HF rope_type values computed here


def _rope(hf):
  """(RoPE base, scaling settings) from either config layout; scaled variants other than
  linear and llama3 (yarn, dynamic, longrope...) are refused by name."""
  theta, scaling = hf.get('rope_theta'), {'type': 'none'}
  for key in ('rope_scaling', 'rope_parameters'):
    rope = hf.get(key) or {}
    rope_type = rope.get('rope_type', rope.get('type', 'default'))
    if rope_type not in ROPE_TYPES:
      raise ValueError(f"{key}.rope_type={rope_type!r} is not implemented (only {', '.join(ROPE_TYPES)})")
    if rope.get('partial_rotary_factor', 1.0) != 1.0:
      raise ValueError(f'{key}.partial_rotary_factor={rope["partial_rotary_factor"]} is not supported by HF Llama')
    theta = rope.get('rope_theta', theta)
    if rope_type != 'default':
      scaling = {'type': rope_type, 'factor': float(rope['factor'])}
      if rope_type == 'llama3':
        scaling.update({k: float(rope[k]) for k in ('low_freq_factor', 'high_freq_factor')},
                       original_max_position_embeddings=int(rope['original_max_position_embeddings']))
  return float(10000.0 if theta is None else theta), scaling


def _rope_to_hf(m) -> dict:
  """rope_scaling as HF writes it (None without scaling)."""
  r = m.get('rope_scaling')
  if r is None or r.type == 'none':
    return None
  out = {'rope_type': r.type, 'factor': r.factor}
  if r.type == 'llama3':
    out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
               original_max_position_embeddings=r.original_max_position_embeddings)
  return out


def config_from_hf(hf_config: dict, base_model):
  """A copy of the `model` config section `base_model` with what an HF LlamaConfig dict sets.

  Keys HF Llama has no counterpart for (optim, dropouts other than attention, fusions...) keep
  `base_model`'s values.
  """
  hf = hf_config
  family = hf.get('model_type')
  if family not in FAMILIES and 'LlamaForCausalLM' not in (hf.get('architectures') or []):
    raise ValueError(f"model_type={family!r}, architectures={hf.get('architectures')}: only "
                     f"{', '.join(FAMILIES)} can be imported")
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
  qwen = family == 'qwen2'
  if hf.get('use_sliding_window') or any(t != 'full_attention' for t in hf.get('layer_types') or []):
    raise ValueError(f'use_sliding_window={hf.get("use_sliding_window")}, layer_types={hf.get("layer_types")}: '
                     'sliding-window attention is not supported yet')
  attention_bias, mlp_bias = bool(hf.get('attention_bias', False)), bool(hf.get('mlp_bias', False))
  if attention_bias != mlp_bias:
    # Our single has_bias switch covers attention and MLP linears together.
    raise ValueError(f'attention_bias={attention_bias} differs from mlp_bias={mlp_bias}; '
                     'flatron supports biases in all linears or none')
  m = copy.deepcopy(base_model)
  m.architecture = 'llama'
  m.hidden_size = hf['hidden_size']
  m.ffn_hidden_size = hf['intermediate_size']
  m.num_layers = hf['num_hidden_layers']
  m.num_attention_heads = hf['num_attention_heads']
  m.num_kv_heads = hf.get('num_key_value_heads') or hf['num_attention_heads']
  head_dim = hf.get('head_dim')
  # 0 means hidden / heads; HF 5.x always writes head_dim, even when it is the default.
  m.head_dim = head_dim if head_dim and head_dim * m.num_attention_heads != m.hidden_size else 0
  m.vocab_size = hf['vocab_size']
  m.max_position_embeddings = hf.get('max_position_embeddings', 2048)
  m.position_embedding_type = 'rope'
  m.rotary_percentage = 1.0
  m.rope_theta, scaling = _rope(hf)
  m.rope_scaling.update(scaling)
  m.normalization = 'rmsnorm'
  m.layernorm_epsilon = float(hf.get('rms_norm_eps', 1e-6))
  m.activation = 'swiglu'
  m.has_bias = attention_bias
  m.qkv_bias = qwen                   # Qwen2: biases on q, k, v only (always)
  m.share_embeddings_and_output_weights = bool(hf.get('tie_word_embeddings', False))
  m.attention_dropout = float(hf.get('attention_dropout', 0.0))
  m.init_method_std = float(hf.get('initializer_range', m.init_method_std))
  return m


def config_to_hf(model_cfg) -> dict:
  """An HF LlamaConfig dict for the `model` section; errors for what HF Llama cannot express.

  hidden_dropout / ffn_dropout are training-only regularizers HF Llama lacks: not exported.
  Query-key layer scaling is exact in fp32 (it divides and multiplies back), so it needs nothing.
  """
  m = model_cfg
  unsupported = {
      'position_embedding_type': (m.position_embedding_type, 'rope'),
      'normalization': (m.normalization, 'rmsnorm'),
      'activation': (m.activation, 'swiglu'),
      'rotary_percentage': (m.rotary_percentage, 1.0),
  }
  for key, (value, needed) in unsupported.items():
    if value != needed:
      raise ValueError(f'model.{key}={value!r} cannot be expressed in HF Llama (needs {needed!r})')
  if m.get('qkv_bias') and m.has_bias:
    raise ValueError('model.qkv_bias with model.has_bias: biases everywhere already include q, k, v')
  qwen = bool(m.get('qkv_bias'))       # q/k/v-only biases: Qwen2's layout
  return {
      'architectures': ['Qwen2ForCausalLM' if qwen else 'LlamaForCausalLM'],
      'model_type': 'qwen2' if qwen else 'llama',
      'hidden_size': m.hidden_size,
      'intermediate_size': m.ffn_hidden_size,
      'num_hidden_layers': m.num_layers,
      'num_attention_heads': m.num_attention_heads,
      'num_key_value_heads': transformer.kv_heads(m),
      'head_dim': transformer.head_dim(m),
      'hidden_act': 'silu',
      'vocab_size': m.vocab_size,
      'max_position_embeddings': m.max_position_embeddings,
      'rms_norm_eps': m.layernorm_epsilon,
      # Both layouts: transformers 4.x reads rope_theta, 5.x rope_parameters.
      'rope_theta': m.rope_theta,
      'rope_parameters': dict(_rope_to_hf(m) or {'rope_type': 'default'}, rope_theta=m.rope_theta),
      'rope_scaling': _rope_to_hf(m),
      'attention_bias': m.has_bias,
      'mlp_bias': m.has_bias,
      'attention_dropout': m.attention_dropout,
      'tie_word_embeddings': m.share_embeddings_and_output_weights,
      'initializer_range': m.init_method_std,
      'pretraining_tp': 1,
      'use_cache': True,
  }


# --- names -------------------------------------------------------------------------------


def _to_hf_name(name):
  return name if name == 'lm_head.weight' else 'model.' + name


def _from_hf_name(hf_name):
  return hf_name[len('model.'):] if hf_name.startswith('model.') else hf_name


def _ignored(hf_name, model_cfg):
  """Tensors HF files may hold that carry nothing for us."""
  if hf_name == 'lm_head.weight' and model_cfg.share_embeddings_and_output_weights:
    return True   # tied: some writers store the (identical) head anyway
  return hf_name.endswith('rotary_emb.inv_freq')   # old checkpoints saved this RoPE buffer


def _few(names, k=5):
  names = sorted(names)
  return ', '.join(names[:k]) + (f' (+{len(names) - k} more)' if len(names) > k else '')


# --- load --------------------------------------------------------------------------------


def _weight_map(path):
  """(HF tensor name -> safetensors file holding it, the file to name in errors)."""
  single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
  if os.path.isfile(single):
    with safe_open(single, framework='pt') as f:
      return {name: single for name in f.keys()}, single
  if os.path.isfile(index):
    with open(index) as f:
      shards = json.load(f)['weight_map']
    files = {name: os.path.join(path, shard) for name, shard in shards.items()}
    absent = sorted({file for file in files.values() if not os.path.isfile(file)})
    if absent:
      raise FileNotFoundError(f'{index} lists shard files that do not exist: {_few(absent)}')
    return files, index
  others = [n for n in ('pytorch_model.bin', 'pytorch_model.bin.index.json') if os.path.exists(os.path.join(path, n))]
  hint = f' (found {", ".join(others)}: re-save it with safe_serialization=True)' if others else ''
  raise FileNotFoundError(f'{path}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found{hint}')


def read_config(path, base_model):
  """The model section for an HF `config.json` (or a directory holding one)."""
  config_path = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f'{config_path} not found (an HF model directory needs one)')
  with open(config_path) as f:
    hf_config = json.load(f)
  try:
    return config_from_hf(hf_config, base_model)
  except (KeyError, ValueError) as e:
    raise ValueError(f'{config_path}: {e}') from None


def _checked_names(path, model_cfg):
  """(our name -> (file, HF name)) for every parameter, after checking names and shapes."""
  specs = transformer.param_specs(model_cfg, adapters=False)
  files, source = _weight_map(path)
  ours = {_from_hf_name(n): n for n in files if not _ignored(n, model_cfg)}
  missing = [_to_hf_name(n) for n in specs if n not in ours]
  if missing:
    raise ValueError(f'{source}: missing tensors {_few(missing)}')
  unexpected = [ours[n] for n in ours if n not in specs]
  if unexpected:
    raise ValueError(f'{source}: unexpected tensors {_few(unexpected)}')
  by_file = {}
  for name in specs:
    by_file.setdefault(files[ours[name]], []).append(name)
  for file, names in by_file.items():
    with safe_open(file, framework='pt') as f:
      for name in names:
        shape = specs[name].shape
        expected = (model_cfg.vocab_size,) + shape[1:] if name in VOCAB_PARAMS else shape
        found = tuple(f.get_slice(ours[name]).get_shape())
        if found != expected:
          raise ValueError(f'{file}: tensor {ours[name]} has shape {found}, expected {expected}')
  return {name: (files[ours[name]], ours[name]) for name in specs}


def read_boxes(path, model_cfg, requests, dtype=torch.float32):
  """{name: box} -> {name: tensor}: only these boxes are read from the safetensors files (each
  rank of a parallel layout reads its own part, never the whole model). Boxes of vocab tables
  must lie within the unpadded vocabulary."""
  where = _checked_names(path, model_cfg)
  out = {}
  by_file = {}
  for name in requests:
    by_file.setdefault(where[name][0], []).append(name)
  for file, names in by_file.items():
    with safe_open(file, framework='pt') as f:
      for name in names:
        tensor = f.get_slice(where[name][1])[tuple(requests[name])]
        out[name] = tensor if dtype is None else tensor.to(dtype)
  return out


def load_hf(path, base_model, dtype=torch.float32):
  """(model config section, params) from an HF Llama directory; vocab rows zero-padded as ours.

  `base_model` supplies the keys HF does not set (see config_from_hf). dtype=None keeps each
  tensor's stored dtype.
  """
  model_cfg = read_config(path, base_model)
  specs = transformer.param_specs(model_cfg, adapters=False)
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
    raise ValueError(f'params do not match the config: missing {_few(missing) or "none"}, '
                     f'unexpected {_few(unexpected) or "none"}')
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


def save_hf(path, model_cfg, params, max_shard_bytes=None):
  """Write an HF Llama directory (config.json + safetensors, sharded past max_shard_bytes)."""
  hf_config = config_to_hf(model_cfg)
  specs = transformer.param_specs(model_cfg, adapters=False)
  _check_params(model_cfg, params, specs)
  tensors = {}
  for name in specs:
    tensor = params[name].detach()
    if name in VOCAB_PARAMS:
      tensor = tensor[:model_cfg.vocab_size]
    tensors[_to_hf_name(name)] = tensor.to('cpu').contiguous()
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


def is_hf_dir(path) -> bool:
  """Whether `path` (a local directory) holds an HF model's config.json."""
  return os.path.isfile(os.path.join(path, CONFIG_FILE))
