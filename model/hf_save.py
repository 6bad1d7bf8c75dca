"""flatron -> a Hugging Face model directory: config.json (model/hf_export.py) and safetensors,
sharded past a size, as transformers' from_pretrained reads them; and the special token ids and
generation_config.json beside them. The reading side is model/hf.py."""
import json
import os

import torch
from safetensors.torch import save_file

from model import hf_gpt_oss, param_table
from model.hf_export import config_to_hf
from model.hf_files import CONFIG_FILE, INDEX_FILE, SHARD_PATTERN, VOCAB_PARAMS, WEIGHTS_FILE, read_json
from model.hf_names import family, few, fused_rows, layout, transposed_stack


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
