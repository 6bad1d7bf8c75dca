"""An NxD Training (or NeMo-Megatron) YAML config, run as it is:

    python train.py --config=configs/nxd_yaml.py:path/to/hf_llama3_8B_config.yaml --workdir=runs/x \
        --config.trainer.max_steps=10            # flatron overrides on top, as with any config

The YAML is read with its interpolations (configs/yaml_config.py), every key is mapped to
flatron's (configs/nxd_yaml_keys.py's `RULES`; a key at the same path in configs/base.py maps to itself), and the
keys that do nothing here are printed once, in one table, with the reason. Keys flatron does
not know are one error listing all of them with the closest known names. `to_yaml` writes a
flatron config back as NxD YAML (tools/export_yaml.py); docs/nxd-migration.md's table comes from `table()`.
"""
import dataclasses
import difflib
import os
import sys

from ml_collections import config_dict

from configs import base, cli, yaml_config
from configs.nxd_yaml_keys import (DOCUMENTED, FP32_GRADS_CC, MANUAL, MANUAL_KNOBS, PRECISION_KEYS,  # pylint: disable=unused-import
                               RULES, TOKENIZER_KEYS, XLA_DTYPE, describe, lacks, missing_feature,
                               table)   # describe, table, lacks, DOCUMENTED: re-exported


def _flatten(tree):
  return cli.flatten(tree, leaves=('data.data_prefix',))   # data_prefix: a list or a {split: list} mapping


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
  elif library == 'megatron' and kind not in (None, 'GPT2BPETokenizer') and not section.get('vocab_file'):
    # NeMo's megatron library hands a name it does not know to HF's AutoTokenizer
    t.type = 'huggingface'
    t.model = os.path.join(str(kind), 'tokenizer.json')
  elif library == 'megatron' or section.get('vocab_file'):
    t.type = 'gpt2'
    if kind not in (None, 'GPT2BPETokenizer'):
      raise ValueError(f'data.tokenizer.type={kind!r} with library megatron and a vocab_file: only '
                       'GPT2BPETokenizer is supported')
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
    if key in PRECISION_KEYS:
      if PRECISION_KEYS[key]:
        _set(config, PRECISION_KEYS[key], value)
      else:
        report.append((f'precision.{key}', value, FP32_GRADS_CC))
      continue
    if key not in MANUAL_KNOBS:
      raise ValueError(f'precision.{key} is unknown; valid: type, {", ".join([*MANUAL_KNOBS, *PRECISION_KEYS])}')
    target, convert = MANUAL_KNOBS[key]
    if kind != 'manual':
      report.append((f'precision.{key}', value, MANUAL))
    elif target is None:
      report.append((f'precision.{key}', value, XLA_DTYPE))
    else:
      config.precision[target] = convert(value)


def _missing_feature(path, flat):
  """One line naming the feature a file needs that flatron does not have yet, or None."""
  asked = {}
  for key, value in flat.items():
    feature = missing_feature(key, value)
    if feature:
      asked.setdefault(feature, []).append(f'{key}={value!r}')
  for feature, keys in asked.items():
    more = f' and {len(keys) - 3} more' if len(keys) > 3 else ''
    return f'{path}: needs {feature} ({", ".join(keys[:3])}{more}), which flatron does not have yet'
  return None


def _objective(tree, config, _report):
  """A model_alignment_strategy.dpo or .orpo section selects its objective, as in NxD."""
  chosen = [k for k in ('dpo', 'orpo') if k in (tree.get('model_alignment_strategy') or {})]
  if len(chosen) > 1:
    raise ValueError('model_alignment_strategy has both dpo and orpo sections; keep the one to train')
  if chosen:
    explicit = (tree.get('model') or {}).get('objective')
    if explicit not in (None, chosen[0]):
      raise ValueError(f'model.objective={explicit!r} but the file has a model_alignment_strategy.{chosen[0]} '
                       f'section; remove one of them')
    config.model.objective = chosen[0]


def load(path) -> Mapped:
  """The flatron config for the NxD YAML at `path`, and the keys it does not honour."""
  tree = yaml_config.read(path)
  config = base.get_config()
  known = _known(config)
  # an empty section (`dpo:` or `dpo: {}`) keeps flatron's defaults; it still selects (`_objective`)
  flat = {k: v for k, v in _flatten(tree).items()
          if not (v in (None, {}) and any(name.startswith(k + '.') for name in known))}
  missing = _missing_feature(path, flat)
  if missing:
    raise ValueError(missing)
  unknown = sorted(k for k in flat if k not in RULES and k not in known and not k.startswith('precision.')
                   and not (k.startswith('data.tokenizer.') and k.split('.')[2] in TOKENIZER_KEYS))
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
  for section, apply in ((tree.get('data', {}).get('tokenizer'), _tokenizer), (tree.get('precision'), _precision),
                         (tree, _objective)):
    try:
      apply(section or {}, config, report)
    except (ValueError, TypeError) as e:
      problems.append(str(e))
  if problems:
    raise ValueError(f'{path}: {len(problems)} value(s) flatron cannot take:\n  - ' + '\n  - '.join(problems))
  model = tree.get('model', {})
  if config.model_source == 'megatron' and 'vocab_size' not in model and config.data.tokenizer.type != 'none':
    config.model.vocab_size = 0           # the tokenizer's, at start-up (from_files.apply_tokenizer_vocab)
  if tree.get('model_source') == 'hf' and 'model_config_overrides' not in model:
    # the YAML's architecture keys win over config.json (NxD's rule); a flatron export names them
    config.model.model_config_overrides = tuple(
        k for k, v in model.items() if not isinstance(v, dict) and f'model.{k}' in known
        and k not in ('model_config', 'model_config_overrides') and isinstance(_get(config, f'model.{k}'), (int, float)))
    # and the YAML's MoE settings (capacity, dropless...) over config.json's (HF routes dropless)
    config.model.model_config_overrides += tuple(f'moe.{k}' for k in model.get('moe') or {})
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
    raise ValueError('configs/nxd_yaml.py needs the YAML after a colon: --config=configs/nxd_yaml.py:path/to/config.yaml')
  if not isinstance(yaml_config.read(arg).get('model'), dict):   # cut short, or not an NxD Training config
    raise ValueError(f'{arg}: no model section (NxD Training\'s model: with model_config or the sizes); '
                     'is it the whole file?')
  mapped = load(arg)
  if mapped.not_honoured and os.environ.get('RANK', '0') == '0':
    print(report_table(mapped.not_honoured), file=sys.stderr)
  return mapped.config


# --- flatron -> NxD YAML, and the docs' table

def to_tree(config) -> dict:
  """A flatron config as an NxD YAML tree: every key at its NxD place (renamed keys at their NxD
  names, flatron's own keys where they are, so `load` reads it back to the same config)."""
  renamed = {r.target: k for k, r in RULES.items() if r.target and r.exported}
  # a dpo / orpo section selects its objective (`_objective`): only the run's own is written
  unused = tuple(f'model_alignment_strategy.{k}.' for k in ('dpo', 'orpo') if k != config.model.objective)
  tree = {}
  for key, value in _flatten(config.to_dict()).items():
    if key.startswith(('data.tokenizer.', 'model.peft.', 'precision.', *unused)) or key == 'model.peft':
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
  if p.parallel_layers_reduce_dtype is not None:
    tree['precision']['parallel_layers_reduce_dtype'] = p.parallel_layers_reduce_dtype
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
