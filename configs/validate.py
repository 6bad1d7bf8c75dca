"""One up-front check of the whole config: every problem, each naming its key and the fix.

Runs before any process group or tensor exists, so a bad launch fails in a second with the
complete list instead of one error per attempt.
"""
import math
import re

from checkpoint import steps as checkpoint_steps
from data import errors as data_errors, gpt_dataset
from model import lora, objectives
from optim import optimizers, schedules
from parallel import precision

DEVICES = ('auto', 'cpu', 'cuda', 'xla')
MODEL_SOURCES = ('megatron', 'hf')
NORMALIZATIONS = ('rmsnorm', 'layernorm')
ACTIVATIONS = ('swiglu', 'geglu', 'gelu')
POSITIONS = ('rope', 'learned_absolute')
ARCHITECTURES = ('llama', 'gpt', 'mistral', 'qwen2', 'gemma3')
RECOMPUTE_GRANULARITIES = (None, 'selective', 'full')
RECOMPUTE_PARTS = ('attention', 'mlp', 'norm', 'activation')   # parallel/remat.PARTS
TOKENIZERS = ('none', 'sentencepiece', 'huggingface', 'gpt2')
NONFINITE_POLICIES = ('error', 'skip')
ROPE_SCALINGS = ('none', 'linear', 'dynamic', 'llama3')
LAYER_TYPES = ('full_attention', 'sliding_attention')


class ConfigError(ValueError):
  pass


def _one_of(problems, key, value, allowed):
  if value not in allowed:
    problems.append(f'{key}={value!r} is unknown; valid: {", ".join(map(str, allowed))}')


def _positive(problems, key, value, allow_zero=False):
  bound = '>= 0' if allow_zero else '> 0'
  if isinstance(value, float) and not math.isfinite(value):   # nan compares false with everything
    problems.append(f'{key}={value} must be a finite number {bound}')
  elif value < 0 or (value == 0 and not allow_zero):
    problems.append(f'{key}={value} must be {bound}')


def check(config, world_size=1) -> list:
  """Every problem in `config` for a run on `world_size` processes, as messages."""
  problems = []
  model, strategy, data, trainer = config.model, config.distributed_strategy, config.data, config.trainer
  _one_of(problems, 'device', config.device, DEVICES)
  _one_of(problems, 'model_source', config.model_source, MODEL_SOURCES)
  for key in model.model_config_overrides:
    if key not in model or isinstance(model[key], type(model)):
      problems.append(f'model.model_config_overrides names {key!r}, which is not a model key; '
                      'list keys of the model section, e.g. (\'num_layers\', \'hidden_size\')')
  if config.model_source == 'hf' and not model.model_config:
    problems.append('model_source=hf needs model.model_config: the path of an HF config.json '
                    '(or the model directory holding it)')

  _positive(problems, 'bucket_size_collectives', config.bucket_size_collectives)

  # --- trainer
  _positive(problems, 'trainer.max_steps', trainer.max_steps)
  _positive(problems, 'trainer.log_every_n_steps', trainer.log_every_n_steps)
  _positive(problems, 'trainer.val_check_interval', trainer.val_check_interval, allow_zero=True)
  _positive(problems, 'trainer.limit_val_batches', trainer.limit_val_batches, allow_zero=True)
  _positive(problems, 'trainer.num_sanity_val_steps', trainer.num_sanity_val_steps, allow_zero=True)
  _positive(problems, 'trainer.gradient_clip_val', trainer.gradient_clip_val, allow_zero=True)
  _one_of(problems, 'trainer.nonfinite_policy', trainer.nonfinite_policy, NONFINITE_POLICIES)
  _positive(problems, 'trainer.max_consecutive_skips', trainer.max_consecutive_skips)
  _positive(problems, 'trainer.exit_interval', trainer.exit_interval, allow_zero=True)
  problems += _check_epochs_and_test(config)

  # --- model
  _one_of(problems, 'model.architecture', model.architecture, ARCHITECTURES)
  _one_of(problems, 'model.normalization', model.normalization, NORMALIZATIONS)
  _one_of(problems, 'model.activation', model.activation, ACTIVATIONS)
  _one_of(problems, 'model.position_embedding_type', model.position_embedding_type, POSITIONS)
  for key in ('num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads', 'vocab_size',
              'max_position_embeddings', 'make_vocab_size_divisible_by', 'init_method_std',
              'layernorm_epsilon', 'rope_theta'):
    _positive(problems, f'model.{key}', model[key])
  heads, kv = model.num_attention_heads, model.num_kv_heads or model.num_attention_heads
  if model.head_dim == 0 and heads > 0 and model.hidden_size % heads:
    problems.append(f'model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads={heads}; '
             'change one or set model.head_dim')
  _positive(problems, 'model.num_kv_heads', model.num_kv_heads, allow_zero=True)
  if heads > 0 and kv > 0 and heads % kv:
    problems.append(f'model.num_kv_heads={model.num_kv_heads} must divide model.num_attention_heads={heads} '
             '(0 means num_attention_heads)')
  scaling = model.rope_scaling
  _one_of(problems, 'model.rope_scaling.type', scaling.type, ROPE_SCALINGS)
  if scaling.type != 'none':
    _positive(problems, 'model.rope_scaling.factor', scaling.factor)
  if scaling.type == 'llama3' and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
    problems.append(f'model.rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor '
                    f'(got {scaling.low_freq_factor}, {scaling.high_freq_factor})')
  _positive(problems, 'model.sliding_window', model.sliding_window, allow_zero=True)
  _positive(problems, 'model.rope_local_theta', model.rope_local_theta, allow_zero=True)
  _positive(problems, 'model.query_pre_attn_scalar', model.query_pre_attn_scalar, allow_zero=True)
  if model.layer_types:
    for kind in model.layer_types:
      _one_of(problems, 'model.layer_types', kind, LAYER_TYPES)
    if len(model.layer_types) != model.num_layers:
      problems.append(f'model.layer_types has {len(model.layer_types)} entries for model.num_layers='
                      f'{model.num_layers} layers; give one per layer (or () for all alike)')
    if 'sliding_attention' in model.layer_types and not model.sliding_window:
      problems.append('model.layer_types has sliding_attention layers but model.sliding_window=0; set the window')
  if (model.rmsnorm_unit_offset or model.qk_norm or model.sandwich_norm) and model.normalization != 'rmsnorm':
    problems.append(f'model.rmsnorm_unit_offset / qk_norm / sandwich_norm need model.normalization=rmsnorm '
                    f'(got {model.normalization!r})')
  if model.qkv_bias and model.has_bias:
    problems.append('model.qkv_bias=True with model.has_bias=True: biases everywhere already include q, k, v; '
                    'set one of them')
  if not 0.0 < model.rotary_percentage <= 1.0:
    problems.append(f'model.rotary_percentage={model.rotary_percentage} must be in (0, 1]')
  for key in ('hidden_dropout', 'attention_dropout', 'ffn_dropout'):
    if not 0.0 <= model[key] < 1.0:
      problems.append(f'model.{key}={model[key]} must be in [0, 1)')
  _one_of(problems, 'model.activations_checkpoint_granularity', model.activations_checkpoint_granularity,
          RECOMPUTE_GRANULARITIES)
  for part in model.activations_checkpoint_recompute:
    _one_of(problems, 'model.activations_checkpoint_recompute', part, RECOMPUTE_PARTS)
  if model.position_embedding_type == 'learned_absolute' and data.seq_length > model.max_position_embeddings:
    problems.append(f'data.seq_length={data.seq_length} exceeds model.max_position_embeddings='
             f'{model.max_position_embeddings} (learned positions); raise max_position_embeddings')
  problems += [f'model.optim: {msg}' if not msg.startswith('model.optim') else msg
        for msg in optimizers.check(model.optim) + schedules.check_schedule(model.optim.sched, trainer.max_steps)]

  # --- parallel layout
  tp, pp, vp = (strategy.tensor_model_parallel_size, strategy.pipeline_model_parallel_size,
                strategy.virtual_pipeline_model_parallel_size)
  for key in ('tensor_model_parallel_size', 'pipeline_model_parallel_size',
              'virtual_pipeline_model_parallel_size', 'kv_replicator'):
    _positive(problems, f'distributed_strategy.{key}', strategy[key])
  if min(tp, pp, vp, strategy.kv_replicator) <= 0:
    return problems
  if world_size % (tp * pp):
    problems.append(f'world size {world_size} is not divisible by tensor_model_parallel_size x '
             f'pipeline_model_parallel_size = {tp} x {pp}; launch a multiple of {tp * pp} processes')
  dp = max(1, world_size // (tp * pp))
  if heads % tp:
    problems.append(f'model.num_attention_heads={heads} is not divisible by '
             f'distributed_strategy.tensor_model_parallel_size={tp}')
  if model.ffn_hidden_size % tp:
    problems.append(f'model.ffn_hidden_size={model.ffn_hidden_size} is not divisible by '
             f'distributed_strategy.tensor_model_parallel_size={tp}')
  if 0 < kv < tp:                  # kv <= 0 is reported above; both branches divide by it
    if kv * strategy.kv_replicator != tp:
      problems.append(f'tensor_model_parallel_size={tp} > model.num_kv_heads={kv}: set '
               f'distributed_strategy.kv_replicator={tp // kv if tp % kv == 0 else "?"} so that '
               f'num_kv_heads x kv_replicator = tp (now {kv} x {strategy.kv_replicator})'
               + ('' if tp % kv == 0 else '; tp must be a multiple of num_kv_heads'))
  elif kv > 0:
    if kv % tp:
      problems.append(f'model.num_kv_heads={kv} is not divisible by tensor_model_parallel_size={tp}')
    if strategy.kv_replicator != 1:
      problems.append(f'distributed_strategy.kv_replicator={strategy.kv_replicator} needs tp > num_kv_heads '
               f'({tp} <= {kv}); set it to 1')
  if strategy.sequence_parallel and data.seq_length % tp:
    problems.append(f'data.seq_length={data.seq_length} is not divisible by tensor_model_parallel_size={tp} '
             '(needed by sequence_parallel)')
  if model.num_layers < pp * vp:
    problems.append(f'model.num_layers={model.num_layers} < pipeline_model_parallel_size x '
             f'virtual_pipeline_model_parallel_size = {pp} x {vp}: every chunk needs a layer')
  elif vp > 1 and model.num_layers % (pp * vp):
    problems.append(f'model.num_layers={model.num_layers} is not divisible by pp x virtual = {pp * vp} '
             '(interleaved schedules need equal chunks)')
  if strategy.pipeline_cuts:
    cuts = list(strategy.pipeline_cuts)
    if len(cuts) != pp * vp - 1 or cuts != sorted(set(cuts)) or not all(0 < x < model.num_layers for x in cuts):
      problems.append(f'distributed_strategy.pipeline_cuts={tuple(cuts)} must be pp x virtual - 1 = '
               f'{pp * vp - 1} increasing layer indices in (0, {model.num_layers})')
  if vp > 1 and pp == 1:
    problems.append(f'distributed_strategy.virtual_pipeline_model_parallel_size={vp} needs '
             'pipeline_model_parallel_size > 1 (interleaving splits a stage across PP ranks)')

  # --- data
  _positive(problems, 'data.micro_batch_size', data.micro_batch_size)
  _positive(problems, 'data.seq_length', data.seq_length)
  if data.micro_batch_size > 0 and data.global_batch_size % (data.micro_batch_size * dp):
    problems.append(f'data.global_batch_size={data.global_batch_size} is not divisible by micro_batch_size x '
             f'data-parallel size = {data.micro_batch_size} x {dp}; use a multiple of '
             f'{data.micro_batch_size * dp}')
  _one_of(problems, 'data.tokenizer.type', data.tokenizer.type, TOKENIZERS)
  if data.data_prefix and len(data.data_prefix) > 1 and len(data.data_prefix) % 2:
    problems.append('data.data_prefix must be (prefix,) or (weight1, prefix1, weight2, prefix2, ...)')
  if not data.data_prefix and data.synthetic_vocab_size > model.vocab_size:
    problems.append(f'data.synthetic_vocab_size={data.synthetic_vocab_size} exceeds model.vocab_size={model.vocab_size}')

  problems += _check_peft(config.model_alignment_strategy.peft)
  problems += _check_objective(config)

  # --- precision and experiment manager
  problems += precision.check(config.precision)
  e = config.exp_manager
  if e.checkpoint_callback_params.save_top_k == 0 or e.checkpoint_callback_params.save_top_k < -1:
    problems.append(f'exp_manager.checkpoint_callback_params.save_top_k={e.checkpoint_callback_params.save_top_k} '
             'must be > 0 (steps kept) or -1 (keep all)')
  _positive(problems, 'exp_manager.checkpoint_callback_params.every_n_train_steps',
            e.checkpoint_callback_params.every_n_train_steps, allow_zero=True)
  problems += _check_experiment(config)
  return problems


def _records(config) -> bool:
  """Whether the data are SFT / preference records (else a corpus or the synthetic stream)."""
  return bool(config.data.train_dir) or config.model.objective in ('dpo', 'orpo')


def _check_epochs_and_test(config) -> list:
  """trainer.max_epochs, check_val_every_n_epoch and limit_test_batches against the data."""
  problems, t, data = [], config.trainer, config.data
  if t.max_epochs != -1:
    _positive(problems, 'trainer.max_epochs', t.max_epochs)
  if t.check_val_every_n_epoch is not None:
    _positive(problems, 'trainer.check_val_every_n_epoch', t.check_val_every_n_epoch)
  synthetic = not data.data_prefix and not _records(config)
  for key, value, off in (('max_epochs', t.max_epochs, '-1'),
                          ('check_val_every_n_epoch', t.check_val_every_n_epoch, 'None')):
    if synthetic and value is not None and value > 0:
      problems.append(f'trainer.{key}={value} counts passes over the train split, but the synthetic stream '
                      f'(data.data_prefix=()) has no epochs; set data.data_prefix or data.train_dir, or '
                      f'trainer.{key}={off}')
  _positive(problems, 'trainer.limit_test_batches', t.limit_test_batches, allow_zero=True)
  if t.limit_test_batches > 0 and _records(config) and not data.test_dir:
    problems.append(f'trainer.limit_test_batches={t.limit_test_batches} evaluates the test records: set '
                    'data.test_dir (same formats as data.val_dir), or trainer.limit_test_batches=0')
  elif t.limit_test_batches > 0 and data.data_prefix and not _records(config):
    try:
      if gpt_dataset.parse_splits(data.splits_string)[2] == 0:
        problems.append(f'data.splits_string={data.splits_string!r} gives the test split no documents but '
                        f'trainer.limit_test_batches={t.limit_test_batches}; give its third part a share '
                        "(e.g. '980,10,10') or set trainer.limit_test_batches=0")
    except data_errors.DataError as e:
      problems.append(str(e))
  return problems


def _check_experiment(config) -> list:
  """The run directory's names and how checkpoints are ranked and named."""
  problems, e = [], config.exp_manager
  p, key = e.checkpoint_callback_params, 'exp_manager.checkpoint_callback_params'
  for name_key, name in (('name', config.name), ('exp_manager.name', e.name)):
    if name is not None and (not name or '/' in name):
      problems.append(f'{name_key}={name!r} names a directory (TensorBoard, exp_dir/<name>): use a '
                      'non-empty name without "/"')
  try:
    metrics = objectives.for_config(config).metrics
  except ValueError:
    metrics = ()                        # an unknown objective is reported by _check_objective
  monitors = ('step', 'val_loss') + tuple(f'val_{m}' for m in metrics)
  _one_of(problems, f'{key}.monitor', p.monitor, monitors)
  _one_of(problems, f'{key}.mode', p.mode, checkpoint_steps.MODES)
  if p.monitor != 'step' and config.trainer.limit_val_batches <= 0:
    problems.append(f'{key}.monitor={p.monitor!r} ranks steps by validation, but trainer.limit_val_batches='
                    f'{config.trainer.limit_val_batches}; raise limit_val_batches or monitor \'step\'')
  if p.filename is not None:
    problems += checkpoint_steps.template_problems(p.filename, f'{key}.filename')
  return problems


def _check_objective(config) -> list:
  """model.objective and the preference settings it reads."""
  problems = []
  objective, strategy = config.model.objective, config.model_alignment_strategy
  _one_of(problems, 'model.objective', objective, objectives.NAMES)
  if objective == 'dpo':
    _one_of(problems, 'model_alignment_strategy.dpo.loss_type', strategy.dpo.loss_type, objectives.LOSS_TYPES)
    _positive(problems, 'model_alignment_strategy.dpo.kl_beta', strategy.dpo.kl_beta)
    if not 0.0 <= strategy.dpo.label_smoothing < 0.5:
      problems.append(f'model_alignment_strategy.dpo.label_smoothing={strategy.dpo.label_smoothing} '
                      'must be in [0, 0.5)')
    _one_of(problems, 'model_alignment_strategy.dpo.reference_model', strategy.dpo.reference_model,
            objectives.REFERENCE_MODELS)
    if strategy.dpo.reference_model == 'base' and not lora.settings(config.model):
      problems.append('model_alignment_strategy.dpo.reference_model=base needs LoRA (the base with the adapters '
                      'off); without LoRA the reference is the starting model: set it to start')
  if objective == 'orpo':
    _positive(problems, 'model_alignment_strategy.orpo.beta', strategy.orpo.beta)
    _one_of(problems, 'model_alignment_strategy.orpo.nll_reduction', strategy.orpo.nll_reduction,
            objectives.NLL_REDUCTIONS)
  if objective in ('dpo', 'orpo') and not config.data.train_dir:
    problems.append(f'model.objective={objective} trains on preference pairs: set data.train_dir '
                    '(and data.val_dir) to (prompt, chosen, rejected) records')
  return problems


def _check_peft(peft) -> list:
  """LoRA settings (model_alignment_strategy.peft); nothing to check while lora_rank is 0."""
  key = 'model_alignment_strategy.peft'
  problems = []
  _positive(problems, f'{key}.lora_rank', peft.lora_rank, allow_zero=True)
  if peft.lora_rank <= 0:
    return problems
  _positive(problems, f'{key}.lora_alpha', lora.option(peft, 'lora_alpha'))
  dropout = lora.option(peft, 'lora_dropout')
  if not 0.0 <= dropout < 1.0:
    problems.append(f'{key}.lora_dropout={dropout} must be in [0, 1)')
  _one_of(problems, f'{key}.lora_bias', lora.option(peft, 'lora_bias'), lora.BIASES)
  try:
    if not lora.target_modules(peft):
      problems.append(f'{key}.target_modules is empty; name the projections to adapt, e.g. (\'qkv_proj\',)')
  except ValueError as e:
    problems.append(str(e))
  for name in ('rank_pattern', 'alpha_pattern'):
    for pair in lora.option(peft, name):
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
  return problems


def warnings(config) -> list:
  """Settings that work but are probably not what the user meant."""
  out = []
  m, a = config.model, config.data
  if config.distributed_strategy.sequence_parallel and config.distributed_strategy.tensor_model_parallel_size == 1:
    out.append('distributed_strategy.sequence_parallel=True does nothing at tensor_model_parallel_size=1 (no TP '
               'group to split the sequence over): the run is the same without it, as in Megatron-LM')
  out += schedules.schedule_warnings(m.optim.sched, config.trainer.max_steps)
  if m.position_embedding_type == 'rope' and a.seq_length > m.max_position_embeddings:
    out.append(f'data.seq_length={a.seq_length} exceeds model.max_position_embeddings='
               f'{m.max_position_embeddings}: RoPE extrapolates beyond the trained length')
  return out


def validate(config, world_size=1):
  """Raise ConfigError listing every problem, or return the data-parallel size."""
  problems = check(config, world_size)
  if problems:
    raise ConfigError('invalid config ({} problem{}):\n  - {}'.format(
        len(problems), 's' * (len(problems) > 1), '\n  - '.join(problems)))
  d = config.distributed_strategy
  return world_size // (d.tensor_model_parallel_size * d.pipeline_model_parallel_size)
