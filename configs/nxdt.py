"""An NxD Training (or NeMo-Megatron) YAML config, run as it is:

    python train.py --config=configs/nxdt.py:path/to/hf_llama3_8B_config.yaml --workdir=runs/x \
        --config.trainer.max_steps=10            # flatron overrides on top, as with any config

The YAML is read with its interpolations (configs/yaml_config.py), every key is mapped to
flatron's (`RULES` below; a key at the same path in configs/base.py maps to itself), and the
keys that do nothing here are printed once, in one table, with the reason. Keys flatron does
not know are one error listing all of them with the closest known names. `to_yaml` writes a
flatron config back as NxD YAML (tools/export_yaml.py); the README's table comes from `table()`.
"""
import dataclasses
import difflib
import os
import sys
from typing import Any, Callable, Optional

from ml_collections import config_dict

from configs import base, yaml_config


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one NxD key maps: to a flatron key (through `convert`), or not at all (`reason`).
  `allowed`: for a key not honoured, the values that mean what flatron does anyway; any other
  value is an error, since silently running something else would be wrong."""
  target: Optional[str] = None
  reason: Optional[str] = None
  convert: Optional[Callable[[Any], Any]] = None
  allowed: tuple = ()


def _na(reason, *allowed):
  return Rule(reason=reason, allowed=allowed)


def _batches(value):
  """Lightning's limit_*_batches / val_check_interval: an int count, or a float fraction."""
  if isinstance(value, float):
    if value == 0.0:
      return 0
    raise ValueError(f'{value} is a fraction of the split (Lightning\'s float form); flatron counts global '
                     'batches: give an int')
  return value


_RECOMPUTE_PARTS = {'coreattention': 'attention', 'attention': 'attention', 'mlp': 'mlp',
                    'llamamlp': 'mlp', 'mistralmlp': 'mlp'}


def _recompute(parts):
  out = []
  for part in parts or ():
    name = _RECOMPUTE_PARTS.get(str(part).lower())
    if name is None:
      raise ValueError(f'{part!r} is not a module flatron recomputes; valid: CoreAttention (attention), MLP (mlp)')
    out.append(name)
  return tuple(dict.fromkeys(out))


_TORCHRUN = 'processes come from torchrun (--nproc_per_node x --nnodes); dp is what tp x pp leave of them'
_XSER = 'checkpoints are tensorstore arrays, layout-free and async; xser is torch-xla serialization'
_MANUAL = 'read only with precision.type=manual (as in NxD Training)'
_XLA_DTYPE = 'flatron casts per tensor; no XLA_USE_BF16-style global downcast'

RULES = {
    'trainer.devices': _na(_TORCHRUN),
    'trainer.num_nodes': _na(_TORCHRUN),
    'trainer.val_check_interval': Rule('trainer.val_check_interval', convert=_batches),
    'trainer.limit_val_batches': Rule('trainer.limit_val_batches', convert=_batches),
    'trainer.limit_test_batches': Rule('trainer.limit_test_batches', convert=_batches),
    'exp_manager.exp_log_dir': Rule('exp_manager.explicit_log_dir'),      # the settings page's name for it
    'exp_manager.checkpoint_callback_params.model_parallel_size': _na('checkpoints load at any tp x pp'),
    'exp_manager.log_gradient_norm': _na('grad_norm is on every logged step', True, False),
    'exp_manager.enable_recovery_time_instrumentation': _na('checkpoint save and load times are always logged',
                                                            True, False),
    'exp_manager.save_xser': _na(_XSER, True, False),
    'exp_manager.load_xser': _na(_XSER, True, False),
    'exp_manager.save_bf16': _na('every array is stored in its training dtype', False),
    'exp_manager.ckpt_ptl_version': _na('no PyTorch Lightning: checkpoints are flatron steps'),
    'data.data_impl': _na('Megatron .bin/.idx are memory-mapped (the only implementation)', 'mmap'),
    'data.skip_warmup': _na('the index is memory-mapped lazily: nothing to warm up', True, False),
    'data.num_workers': _na('batches are built in the training process, keyed by sample index'),
    'data.dataloader_type': _na('one sampler, resumable by consumed samples (Megatron\'s single)', 'single'),
    'data.validation_drop_last': _na('validation reads whole global batches (limit_val_batches)', True, False),
    'data.no_seqlen_plus_one_input_tokens': _na('samples are seq_length + 1 tokens (Megatron\'s default)', False),
    'data.pad_samples_to_global_batch_size': _na('every step is a whole global batch', False),
    'data.packing': Rule('model_alignment_strategy.sft.packing'),
    'data.use_sft_style_data_module': _na('records are read from data.train_dir whenever it is set', True, False),
    'data.tokenizer.delimiter': _na('no tabular tokenizer', None),
    'data.tokenizer.sentencepiece_legacy': _na('special tokens come from the tokenizer file', False, True),
    'data.tokenizer.use_fast': _na('HF tokenizers run on the `tokenizers` library (the fast one)', True, False),
    'model.encoder_seq_length': Rule('data.seq_length'),     # data.seq_length, when the YAML sets it, wins
    'model.kv_channels': Rule('model.head_dim', convert=lambda v: v or 0),
    'model.do_layer_norm_weight_decay': Rule('model.optim.do_layer_norm_weight_decay'),
    'model.fusions.do_layer_norm_weight_decay': Rule('model.optim.do_layer_norm_weight_decay'),
    'model.fusions.softmax': _na('softmax is SDPA\'s, or fp32 in the explicit path', True, False),
    'model.persist_layer_norm': _na('norms are plain PyTorch', True, False),
    'model.transformer_block_type': _na('blocks are pre-norm (sandwich_norm adds Gemma\'s post-norms)', 'pre_ln'),
    'model.use_cpu_initialization': _na('init is keyed by (seed, name): the same on every device', True, False),
    'model.qkv_linear': _na('q, k, v are column-parallel; kv_replicator copies KV heads when tp > kv heads',
                            True, False),
    'model.fuse_qkv': _na('q, k, v are separate column-parallel GEMMs (names stay HF\'s)', True, False),
    'model.weight_init_only': Rule('exp_manager.init_from'),    # applied in `load`: see there
    'model.activations_checkpoint_recompute': Rule('model.activations_checkpoint_recompute', convert=_recompute),
    'model.micro_batch_size': Rule('data.micro_batch_size'),          # NeMo's place for it
    'model.global_batch_size': Rule('data.global_batch_size'),
    'model.optim.capturable': _na('set by the device: capturable on XLA, not elsewhere', True, False),
    'model_alignment_strategy.peft.lora_verbose': _na('the start-up summary always shows the adapters', True, False),
    'model_alignment_strategy.peft.save_lora_config_adapter': _na(
        'adapters are saved with their config; tools/convert.py export-peft writes a peft directory', True, False),
    'model_alignment_strategy.peft.merge_sharded_lora': _na('checkpoints are layout-free: adapters are never '
                                                            'sharded on disk', True, False),
}
# The Neuron compiler / runtime keys keep their names; parallel/xla.py reports them at start-up
# on a device where they do nothing. precision's knobs are read only with type manual, as
# in NxD Training: NxD knob -> (flatron knob, its value for the YAML's).
MANUAL_KNOBS = {
    'master_weights': ('master_weights', bool),
    'fp32_grad_acc': ('fp32_grad_acc', bool),
    'xla_use_bf16': ('parameter_dtype', lambda v: 'bf16' if int(v) else 'fp32'),
    'neuron_rt_stochastic_rounding_en': ('stochastic_rounding', lambda v: bool(int(v))),
    'xla_downcast_bf16': (None, None),
}


def _flatten(tree, prefix=''):
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if isinstance(value, dict) and value and path != 'data.data_prefix':
      out.update(_flatten(value, path + '.'))
    else:
      out[path] = value
  return out


def _known(config):
  return set(_flatten(config.to_dict()))


def _get(config, path):
  node = config
  for k in path.split('.'):
    node = node[k]
  return node


def _set(config, path, value):
  *parents, leaf = path.split('.')
  node = config
  for k in parents:
    node = node[k]
  current = node[leaf]
  if isinstance(value, list) and (isinstance(current, tuple) or current is None):
    value = tuple(value)
  node[leaf] = value


@dataclasses.dataclass
class Mapped:
  config: config_dict.ConfigDict
  not_honoured: list       # [(NxD key, value, reason)]


def _tokenizer(section, config, report):
  """NxD's tokenizer section (library + type as the name or path) -> flatron's (type + files)."""
  t = config.data.tokenizer
  library, kind = section.get('library'), section.get('type')
  if kind in ('none', 'sentencepiece', 'huggingface', 'gpt2') and library is None:
    t.type = kind                              # a flatron export
  elif library == 'sentencepiece' or (library is None and str(section.get('model') or '').endswith('.model')):
    t.type = 'sentencepiece'
  elif library == 'megatron' or section.get('vocab_file'):
    t.type = 'gpt2'
    if kind not in (None, 'GPT2BPETokenizer'):
      raise ValueError(f'data.tokenizer.type={kind!r} with library megatron: only GPT2BPETokenizer is supported')
  elif library in (None, 'huggingface') and not kind:
    pass                                       # no tokenizer: synthetic data or pre-tokenized records
  elif library in (None, 'huggingface'):
    t.type = 'huggingface'
    path = str(kind)
    t.model = path if path.endswith('.json') else os.path.join(path, 'tokenizer.json')
  elif library is not None:
    raise ValueError(f'data.tokenizer.library={library!r} is unknown; valid: huggingface, sentencepiece, megatron')
  for key in ('model', 'vocab_file', 'merge_file'):
    if section.get(key) is not None:
      t[key] = section[key]
  for key, value in section.items():
    full = f'data.tokenizer.{key}'
    if full in RULES:
      report.append((full, value, RULES[full].reason))


def _precision(section, config, report):
  """precision.type as it is; the knobs under it only with type manual."""
  kind = section.get('type', config.precision.type)
  config.precision.type = kind
  for key, value in section.items():
    if key == 'type':
      continue
    if key not in MANUAL_KNOBS:
      raise ValueError(f'precision.{key} is unknown; valid: type, {", ".join(MANUAL_KNOBS)}')
    target, convert = MANUAL_KNOBS[key]
    if kind != 'manual':
      report.append((f'precision.{key}', value, _MANUAL))
    elif target is None:
      report.append((f'precision.{key}', value, _XLA_DTYPE))
    else:
      config.precision[target] = convert(value)


def load(path) -> Mapped:
  """The flatron config for the NxD YAML at `path`, and the keys it does not honour."""
  tree = yaml_config.read(path)
  config = base.get_config()
  known = _known(config)
  flat = _flatten(tree)
  unknown = sorted(k for k in flat if k not in RULES and k not in known
                   and not k.startswith(('data.tokenizer.', 'precision.')))
  if unknown:
    names = sorted(known | set(RULES))
    lines = [k + (f' (did you mean {", ".join(m)}?)' if (m := difflib.get_close_matches(k, names, 3, 0.75)) else '')
             for k in unknown]
    raise ValueError(f'{path}: {len(unknown)} key(s) flatron does not know:\n  - ' + '\n  - '.join(lines))
  if isinstance(tree.get('data', {}).get('data_prefix'), dict):
    raise ValueError(f'{path}: data.data_prefix as {{train, validation, test}} is not supported: give '
                     '[weight, prefix, ...]; data.splits_string splits it')
  report, problems = [], []
  for key, value in flat.items():
    rule = RULES.get(key)
    try:
      if key.startswith(('data.tokenizer.', 'precision.')) or key == 'model.weight_init_only':
        continue                         # whole sections below; weight_init_only at the end
      if key == 'model.encoder_seq_length' and 'seq_length' in tree.get('data', {}):
        if value != tree['data']['seq_length']:
          report.append((key, value, 'data.seq_length is set and wins'))
      elif rule is None or rule.target:
        _set(config, rule.target if rule else key, rule.convert(value) if rule and rule.convert else value)
      else:
        if rule.allowed and value not in rule.allowed:
          raise ValueError(f'flatron cannot honour {value!r} ({rule.reason}); valid: '
                           + ', '.join(map(repr, rule.allowed)))
        report.append((key, value, rule.reason))
    except (ValueError, TypeError, KeyError) as e:
      problems.append(f'{key}={value!r}: {e}')
  for section, apply in ((tree.get('data', {}).get('tokenizer'), _tokenizer), (tree.get('precision'), _precision)):
    try:
      apply(section or {}, config, report)
    except (ValueError, TypeError) as e:
      problems.append(str(e))
  if problems:
    raise ValueError(f'{path}: {len(problems)} value(s) flatron cannot take:\n  - ' + '\n  - '.join(problems))
  model = tree.get('model', {})
  if tree.get('model_source') == 'hf' and 'model_config_overrides' not in model:
    # the YAML's architecture keys win over config.json (NxD's rule); a flatron export names them
    config.model.model_config_overrides = tuple(
        k for k, v in model.items() if not isinstance(v, dict) and f'model.{k}' in known
        and k not in ('model_config', 'model_config_overrides') and isinstance(_get(config, f'model.{k}'), (int, float)))
  report += _runtime_keys(config)
  if model.get('weight_init_only') and config.exp_manager.resume_from_checkpoint:
    config.exp_manager.init_from = config.exp_manager.resume_from_checkpoint
    config.exp_manager.resume_from_checkpoint = None
  return Mapped(config, report)


def _runtime_keys(config):
  """The Neuron compiler / runtime keys that do nothing on the device this config would run on
  (parallel/xla.py decides; it reports them again at start-up)."""
  import torch  # pylint: disable=import-outside-toplevel
  from parallel import xla  # pylint: disable=import-outside-toplevel
  device = config.device if config.device != 'auto' else ('cuda' if torch.cuda.is_available() else 'cpu')
  return [(k, v, why.removeprefix('not applicable: ')) for k, v, why in xla.runtime_settings(config, device)
          if why.startswith('not applicable')]


def report_table(rows) -> str:
  lines = ['NxD Training keys not honoured here (flatron does what the reason says):',
           '| key | value | reason |', '|---|---|---|']
  return '\n'.join(lines + [f'| {k} | {v!r} | {why} |' for k, v, why in rows])


def get_config(arg=None):
  if not arg:
    raise ValueError('configs/nxdt.py needs the YAML after a colon: --config=configs/nxdt.py:path/to/config.yaml')
  mapped = load(arg)
  if mapped.not_honoured and os.environ.get('RANK', '0') == '0':
    print(report_table(mapped.not_honoured), file=sys.stderr)
  return mapped.config


# --- flatron -> NxD YAML, and the README's table

def to_tree(config) -> dict:
  """A flatron config as an NxD YAML tree: every key at its NxD place (renamed keys at their NxD
  names, flatron's own keys where they are, so `load` reads it back to the same config)."""
  renamed = {r.target: k for k, r in RULES.items() if r.target and k not in (
      'exp_manager.exp_log_dir', 'model.fusions.do_layer_norm_weight_decay', 'model.micro_batch_size',
      'model.global_batch_size', 'model.weight_init_only')}
  tree = {}
  for key, value in _flatten(config.to_dict()).items():
    if key.startswith(('data.tokenizer.', 'model.peft.', 'precision.')) or key == 'model.peft':
      continue
    nxd = renamed.get(key, key)
    if nxd == 'model.encoder_seq_length':
      _put(tree, 'data.seq_length', value)
    _put(tree, nxd, list(value) if isinstance(value, tuple) else value)
  t = config.data.tokenizer
  _put(tree, 'data.tokenizer', {'type': t.type, 'model': t.model, 'vocab_file': t.vocab_file,
                                'merge_file': t.merge_file})
  p = config.precision
  tree['precision'] = {'type': p.type}
  if p.type == 'manual':
    tree['precision'].update(master_weights=p.master_weights, fp32_grad_acc=p.fp32_grad_acc,
                             xla_use_bf16='1' if p.parameter_dtype == 'bf16' else '0',
                             neuron_rt_stochastic_rounding_en='1' if p.stochastic_rounding else '0')
  return tree


def _put(tree, path, value):
  *parents, leaf = path.split('.')
  for k in parents:
    tree = tree.setdefault(k, {})
  tree[leaf] = value


def to_yaml(config) -> str:
  import yaml  # pylint: disable=import-outside-toplevel
  return yaml.safe_dump(to_tree(config), sort_keys=False, default_flow_style=None)


DOCUMENTED = (  # the keys of NxD Training's "YAML Configuration Settings" page and its example configs
    'name', 'model_source', 'seed', 'compiler_flags', 'compiler_cache_url', 'aync_exec_max_inflight_requests',
    'bucket_size_collectives', 'neuron_rt_exec_timeout', 'neuron_experimental_compress_rg',
    'trainer.devices', 'trainer.num_nodes', 'trainer.max_epochs', 'trainer.max_steps', 'trainer.log_every_n_steps',
    'trainer.val_check_interval', 'trainer.check_val_every_n_epoch', 'trainer.num_sanity_val_steps',
    'trainer.limit_val_batches', 'trainer.limit_test_batches', 'trainer.gradient_clip_val',
    'exp_manager.log_local_rank_0_only', 'exp_manager.create_tensorboard_logger', 'exp_manager.explicit_log_dir',
    'exp_manager.exp_log_dir', 'exp_manager.exp_dir', 'exp_manager.name', 'exp_manager.resume_if_exists',
    'exp_manager.resume_ignore_no_checkpoint', 'exp_manager.create_checkpoint_callback',
    'exp_manager.checkpoint_callback_params.monitor', 'exp_manager.checkpoint_callback_params.save_top_k',
    'exp_manager.checkpoint_callback_params.mode', 'exp_manager.checkpoint_callback_params.save_last',
    'exp_manager.checkpoint_callback_params.filename', 'exp_manager.checkpoint_callback_params.model_parallel_size',
    'exp_manager.checkpoint_callback_params.every_n_train_steps', 'exp_manager.log_parameter_norm',
    'exp_manager.log_gradient_norm', 'exp_manager.enable_recovery_time_instrumentation', 'exp_manager.save_xser',
    'exp_manager.load_xser', 'exp_manager.save_bf16', 'exp_manager.async_checkpointing',
    'exp_manager.resume_from_checkpoint', 'exp_manager.ckpt_ptl_version',
    'distributed_strategy.tensor_model_parallel_size', 'distributed_strategy.pipeline_model_parallel_size',
    'distributed_strategy.virtual_pipeline_model_parallel_size', 'distributed_strategy.zero1',
    'distributed_strategy.sequence_parallel', 'distributed_strategy.kv_replicator',
    'data.micro_batch_size', 'data.global_batch_size', 'data.data_prefix', 'data.index_mapping_dir', 'data.data_impl',
    'data.splits_string', 'data.seq_length', 'data.skip_warmup', 'data.num_workers', 'data.dataloader_type',
    'data.reset_position_ids', 'data.reset_attention_mask', 'data.eod_mask_loss', 'data.validation_drop_last',
    'data.no_seqlen_plus_one_input_tokens', 'data.pad_samples_to_global_batch_size', 'data.train_dir',
    'data.val_dir', 'data.dev_choose_samples', 'data.packing', 'data.use_sft_style_data_module',
    'data.tokenizer.library', 'data.tokenizer.type', 'data.tokenizer.model', 'data.tokenizer.vocab_file',
    'data.tokenizer.merge_file', 'data.tokenizer.delimiter', 'data.tokenizer.sentencepiece_legacy',
    'data.tokenizer.use_fast',
    'model.model_config', 'model.encoder_seq_length', 'model.max_position_embeddings', 'model.num_layers',
    'model.hidden_size', 'model.ffn_hidden_size', 'model.num_attention_heads', 'model.num_kv_heads',
    'model.kv_channels', 'model.init_method_std', 'model.use_scaled_init_method', 'model.hidden_dropout',
    'model.attention_dropout', 'model.ffn_dropout', 'model.apply_query_key_layer_scaling', 'model.normalization',
    'model.layernorm_epsilon', 'model.do_layer_norm_weight_decay', 'model.make_vocab_size_divisible_by',
    'model.persist_layer_norm', 'model.share_embeddings_and_output_weights', 'model.position_embedding_type',
    'model.rotary_percentage', 'model.activation', 'model.transformer_block_type', 'model.has_bias',
    'model.rope_theta', 'model.qkv_linear', 'model.fuse_qkv', 'model.use_cpu_initialization',
    'model.weight_init_only', 'model.activations_checkpoint_granularity', 'model.activations_checkpoint_recompute',
    'model.fusions.softmax', 'model.fusions.flash_attention', 'model.fusions.do_layer_norm_weight_decay',
    'model.optim.name', 'model.optim.lr', 'model.optim.weight_decay', 'model.optim.capturable', 'model.optim.betas',
    'model.optim.sched.name', 'model.optim.sched.warmup_steps', 'model.optim.sched.constant_steps',
    'model.optim.sched.min_lr', 'model.optim.sched.max_steps',
    'model_alignment_strategy.sft.packing', 'model_alignment_strategy.peft.lora_rank',
    'model_alignment_strategy.peft.lora_alpha', 'model_alignment_strategy.peft.lora_dropout',
    'model_alignment_strategy.peft.lora_bias', 'model_alignment_strategy.peft.lora_verbose',
    'model_alignment_strategy.peft.target_modules', 'model_alignment_strategy.peft.load_lora_from_ckpt',
    'model_alignment_strategy.peft.save_lora_base', 'model_alignment_strategy.peft.merge_lora',
    'model_alignment_strategy.peft.save_lora_config_adapter', 'model_alignment_strategy.peft.merge_sharded_lora',
    'precision.type', 'precision.master_weights', 'precision.fp32_grad_acc', 'precision.xla_use_bf16',
    'precision.xla_downcast_bf16', 'precision.neuron_rt_stochastic_rounding_en',
)
_TOKENIZER_NOTES = {
    'data.tokenizer.library': 'data.tokenizer.type (huggingface, sentencepiece; megatron = gpt2)',
    'data.tokenizer.type': 'data.tokenizer.model (HF: the directory\'s tokenizer.json)',
}


def describe(key):
  """(flatron key, note) for one NxD key: where it goes, or why it goes nowhere."""
  if key in _TOKENIZER_NOTES:
    return _TOKENIZER_NOTES[key], ''
  if key.startswith('precision.') and key != 'precision.type':
    target = MANUAL_KNOBS[key.split('.', 1)[1]][0]
    return (f'precision.{target}' if target else '—'), _MANUAL if target else 'not applicable: ' + _XLA_DTYPE
  rule = RULES.get(key)
  if rule is None:
    return key, ''
  if rule.target:
    note = 'True: resume_from_checkpoint loads weights only' if key == 'model.weight_init_only' else ''
    return rule.target, note
  return '—', 'not applicable: ' + rule.reason


def table() -> str:
  """The README's side-by-side table of every documented NxD key."""
  rows = ['| NxD Training key | flatron key | note |', '|---|---|---|']
  for key in DOCUMENTED:
    target, note = describe(key)
    rows.append(f'| `{key}` | {"`" + target + "`" if target != "—" else target} | {note} |')
  return '\n'.join(rows)
