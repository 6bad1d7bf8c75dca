"""What the files a user brings put into the config, before it is validated: an HF
config.json (model_source=hf), the tokenizer's vocabulary (an NxD Megatron file without
model.vocab_size) and a starting LoRA adapter (load_lora_from_ckpt). Each either
fills what the run leaves unset or is refused with both values; nothing is dropped silently.
"""
from ml_collections import config_dict

from checkpoint import steps as checkpoint_steps
from checkpoint.manager import IncompatibleCheckpoint
from configs import validate
from data import tokenizer as tokenizers
from model import adapters, hf, lora, lora_targets, param_table


def resolve(config, world_size) -> list:
  """Fill in what the user's files bring (config.json, the tokenizer's vocabulary, a starting
  adapter's settings), then validate (ConfigError lists every problem). Returns the lines to
  log about what was filled in."""
  if config.model_source == 'hf' and config.model.model_config:    # (validate names a missing one)
    apply_hf_model_config(config)
  notes = [note for note in (apply_tokenizer_vocab(config),) if note]
  resolve_adapter_settings(config)   # LoRA settings left unset: the starting adapter's
  validate.validate(config, world_size)
  return notes


def apply_hf_model_config(config):
  """model_source=hf: the architecture keys of model.model_config (an HF config.json) replace
  the model section's, except those named in model.model_config_overrides (NxD Training's YAML
  sets num_layers, hidden_size... over config.json); the rest (optimizer, dropout, recompute...)
  stays as configured."""
  try:
    hf_model = hf.read_config(config.model.model_config, config.model)
  except (ValueError, FileNotFoundError) as e:
    raise validate.ConfigError(f'model.model_config: {e}') from None
  def copy(src, dst, prefix=''):
    for key, value in src.items():
      if prefix + key in keep:
        continue
      if isinstance(value, config_dict.ConfigDict):
        copy(value, dst[key], f'{prefix}{key}.')   # rope_scaling's, moe's keys (optim, peft... are the base's own)
      elif value != dst[key]:
        dst[key] = value
  keep = set(config.model.model_config_overrides)      # top-level keys, or dotted (moe.dropless)
  copy(hf_model, config.model)


def apply_tokenizer_vocab(config):
  """model.vocab_size=0 (an NxD Megatron file that leaves it out): the tokenizer's vocabulary, as
  NeMo sets it; the embedding pads it to a multiple of make_vocab_size_divisible_by x TP.
  Returns the line to log, or None when the size was given."""
  m = config.model
  if m.vocab_size:
    return None
  if config.data.tokenizer.type == 'none':
    raise validate.ConfigError('model.vocab_size=0 takes the tokenizer\'s size, but data.tokenizer.type is none; '
                               'set model.vocab_size or a tokenizer')
  try:
    m.vocab_size = tokenizers.load_tokenizer(config.data.tokenizer).vocab_size
  except (OSError, ValueError) as e:
    raise validate.ConfigError(f'model.vocab_size=0 takes the tokenizer\'s size: {e}') from None
  tp = config.distributed_strategy.tensor_model_parallel_size
  return (f'model.vocab_size={m.vocab_size}: the tokenizer\'s; the embedding pads it to '
          f'{param_table.padded_vocab_size(m, tp)} rows (a multiple of make_vocab_size_divisible_by '
          f'{m.make_vocab_size_divisible_by} x tp {tp})')


# Settings a starting adapter supplies when the run leaves them unset. Those compared by value
# are refused with both values when they differ; target_modules has many spellings of one
# choice (qkv_proj = q, k, v), so it is compared by what it selects (`_check_same_adapters`).
SCALAR_KEYS = ('lora_alpha', 'use_rslora', 'lora_dropout', 'lora_bias')
PATTERN_KEYS = ('rank_pattern', 'alpha_pattern', 'layers_to_transform')
BY_VALUE = SCALAR_KEYS + PATTERN_KEYS


def _canonical(key, value):
  """A setting as comparable data (tuples for lists, pairs of patterns, floats for numbers)."""
  if key in ('rank_pattern', 'alpha_pattern'):
    items = value.items() if hasattr(value, 'items') else (value or ())
    return tuple((str(k), int(v) if key == 'rank_pattern' else float(v)) for k, v in items)
  if key == 'layers_to_transform':
    return (value,) if isinstance(value, int) else tuple(int(v) for v in (value or ()))
  if key in ('lora_alpha', 'lora_dropout'):
    return float(value)
  return value


def _source_settings(path) -> dict:
  """The LoRA settings a starting adapter was saved with: a peft directory's
  adapter_config.json or a flatron step's config."""
  if adapters.is_peft_dir(path):
    return adapters.read_settings(path)
  if not checkpoint_steps.is_committed(path):
    raise IncompatibleCheckpoint(
        f'model_alignment_strategy.peft.lora_save_dir/lora_load_tag: {path} is neither a peft adapter directory '
        '(adapter_config.json) nor a committed flatron checkpoint step')
  theirs = dict(checkpoint_steps.read_metadata(path)['config']['model_alignment_strategy']['peft'])
  return {k: (lora_targets.DEFAULTS[k] if theirs.get(k) is None and k in lora_targets.DEFAULTS else theirs.get(k)) for k in theirs}


def resolve_adapter_settings(config):
  """LoRA settings left unset take the starting adapter's (load_lora_from_ckpt: alpha, rsLoRA,
  dropout, bias, rank / alpha patterns, layers), then the defaults; a setting this run sets
  to another value than the adapter's, or adapters on other linears or of other ranks, are
  refused with both values. Idempotent: run once before validation, again when loading."""
  peft = lora.settings(config.model)
  if peft is None:
    return
  theirs, path = None, None
  if peft.load_lora_from_ckpt and peft.lora_save_dir:
    path = lora.adapter_source(peft)
    theirs = _source_settings(path)
    differ = []
    for key in BY_VALUE + ('target_modules',):
      mine, value = peft.get(key), theirs.get(key, lora_targets.DEFAULTS.get(key, ()))
      if mine is None or (key in PATTERN_KEYS and not mine):
        peft[key] = _canonical(key, value) if key in PATTERN_KEYS else value
      elif key in BY_VALUE and _canonical(key, mine) != _canonical(key, value):
        differ.append(f'{key}: this run {mine!r}, the adapter {value!r}')
    if differ:
      raise IncompatibleCheckpoint(
          f'{path} was saved with other LoRA settings than this run sets:\n  - ' + '\n  - '.join(differ) +
          '\nLeave them unset (the adapter\'s are then used) or set model_alignment_strategy.peft.* to the '
          'adapter\'s values; loading it with others would change what it computes')
  for key in SCALAR_KEYS + ('target_modules',):
    if peft.get(key) is None:
      peft[key] = lora_targets.DEFAULTS[key]
  if theirs is not None:
    _check_same_adapters(config, theirs, path)


def _check_same_adapters(config, theirs, path):
  """The starting adapter must adapt the same linears with the same ranks as this run."""
  names = param_table.param_specs(config.model, adapters=False)
  mine = lora_targets.plan(config.model, names)
  other = config.model.copy_and_resolve_references()
  other.peft = config_dict.ConfigDict(dict(other.peft.to_dict(), **{k: theirs[k] for k in (
      'lora_rank', 'target_modules', *PATTERN_KEYS) if k in theirs}))
  other_plan = lora_targets.plan(other, names)
  differ = [f'{lin}: this run {"rank " + str(mine[lin][0]) if lin in mine else "no adapter"}, the adapter '
            f'{"rank " + str(other_plan[lin][0]) if lin in other_plan else "none"}'
            for lin in sorted(set(mine) | set(other_plan))
            if (mine.get(lin) or (None,))[0] != (other_plan.get(lin) or (None,))[0]]
  if differ:
    shown = '\n  - '.join(differ[:6]) + (f'\n  ... and {len(differ) - 6} more' if len(differ) > 6 else '')
    raise IncompatibleCheckpoint(
        f'{path} holds adapters on other linears or of other ranks than this run trains ({len(differ)} differ):\n'
        f'  - {shown}\nSet model_alignment_strategy.peft.lora_rank, target_modules (and rank_pattern, '
        f'layers_to_transform) to the adapter\'s: r={theirs.get("lora_rank")}, '
        f'target_modules={theirs.get("target_modules")!r}')
