"""One up-front check of the whole config: every problem, each naming its key and the fix.

Runs before any process group or tensor exists, so a bad launch fails in a second with the
complete list instead of one error per attempt. Each section is checked by the code that
reads it (model/checks.py, parallel/mesh.py, data/loader.py, ...); `check` gathers them in
one fixed order. What only train.py reads (the top-level keys, trainer's knobs) is checked here.
"""
from checkpoint import steps as checkpoint_steps
from config_checks import one_of, positive
from data import loader
from estimates import clusters
from model import checks as model_checks, layers, lora_targets, moe, moe_checks, objectives
from monitor import profiling, trackers
from numerics import precision
from optim import optimizers, schedules
from parallel import compiled, context, device as devices, grad_reduce, layer_stats, mesh as meshes, param_shards, pipeline, remat, tensor
from user_errors import UserError

MODEL_SOURCES = ('megatron', 'hf')
NONFINITE_POLICIES = ('error', 'skip')


class ConfigError(UserError, ValueError):
  pass


def check(config, world_size=1) -> list:
  """Every problem in `config` for a run on `world_size` processes, as messages."""
  model, strategy = config.model, config.distributed_strategy
  problems = _check_run(config) + loader.check_epochs(config)
  problems += model_checks.check(model, config.data.seq_length) + remat.check(model) + compiled.check(config)
  problems += _check_optim(config) + grad_reduce.check(strategy) + param_shards.check(config)
  sizes = meshes.check_sizes(strategy)
  if sizes:                   # the layout checks and the batch check divide by the degrees: they wait for a fix
    problems += sizes
  else:
    problems += (meshes.check(strategy, world_size) + tensor.check(model, strategy, config.data.seq_length)
                 + pipeline.check(model.num_layers, strategy) + moe_checks.check_layout(model, strategy)
                 + context.check(config))
    dp = max(1, world_size // _model_parallel(strategy))
    problems += loader.check(config, dp)
  problems += lora_targets.check(config.model_alignment_strategy.peft, config.model) + objectives.check(config)
  return problems + precision.check(config.precision) + _check_fp8(config) + checkpoint_steps.check(config) + \
      trackers.check(config) + profiling.check(config, world_size) + layer_stats.check(config)


def _check_fp8(config) -> list:
  """precision.fp8 where its GEMMs run: CUDA's float8 GEMMs need every dim a multiple of 16."""
  name, m = config.precision.get('fp8'), config.model
  if name is None:
    return []
  if config.device == 'xla':
    return [f'precision.fp8={name!r}: FP8 linears run on CUDA (sm_89+) and the CPU; XLA (Trainium, TPU) has no '
            'torch._scaled_mm path here: unset precision.fp8']
  tp, hd = config.distributed_strategy.tensor_model_parallel_size, layers.head_dim(m)
  dims = {'hidden_size': m.hidden_size, 'num_attention_heads x head_dim / tp': m.num_attention_heads * hd // tp,
          'ffn_hidden_size / tp': m.ffn_hidden_size // tp}
  if moe.enabled(m):
    dims['the experts\' ffn size / tp'] = moe.expert_ffn_size(m) // tp
  odd = [f'{k}={v}' for k, v in dims.items() if v % 16]
  if config.device == 'cuda' and odd:
    return [f'precision.fp8={name!r} on CUDA needs each linear dim a multiple of 16 (torch._scaled_mm): '
            f'{", ".join(odd)}']
  return []


def _check_run(config) -> list:
  """The top-level keys and trainer's own knobs (train.py reads them)."""
  problems, model, trainer = [], config.model, config.trainer
  problems += devices.check_name(config.device) + devices.check_backend(config.get('backend', 'auto'))
  one_of(problems, 'model_source', config.model_source, MODEL_SOURCES)
  if devices.trim_setting(config) not in ('auto', True, False):
    problems.append(f'trim_host_heap={config.trim_host_heap!r}: one of auto, True, False')
  for key in model.model_config_overrides:
    section, _, leaf = key.rpartition('.')        # a dotted key names one inside a section (moe.dropless)
    holder = model if not section else model[section] if section in model else {}
    if leaf not in holder or isinstance(holder[leaf], type(model)):
      problems.append(f'model.model_config_overrides names {key!r}, which is not a model key; '
                      'list keys of the model section, e.g. (\'num_layers\', \'hidden_size\')')
  if config.model_source == 'hf' and not model.model_config:
    problems.append('model_source=hf needs model.model_config: the path of an HF config.json '
                    '(or the model directory holding it)')
  if config.model_source != 'hf' and model.model_config:
    problems.append(f'model.model_config={model.model_config!r} is read only with model_source=hf (NxD\'s rule); '
                    f'set model_source=hf to take the architecture from it, or unset it (model_source={config.model_source})')
  positive(problems, 'bucket_size_collectives', config.bucket_size_collectives)
  positive(problems, 'trainer.max_steps', trainer.max_steps)
  positive(problems, 'trainer.log_every_n_steps', trainer.log_every_n_steps)
  for key in ('val_check_interval', 'limit_val_batches', 'num_sanity_val_steps', 'gradient_clip_val'):
    positive(problems, f'trainer.{key}', trainer[key], allow_zero=True)
  one_of(problems, 'trainer.nonfinite_policy', trainer.nonfinite_policy, NONFINITE_POLICIES)
  one_of(problems, 'trainer.plan_cluster', trainer.plan_cluster, ('auto', 'none', *clusters.names()))
  positive(problems, 'trainer.max_consecutive_skips', trainer.max_consecutive_skips)
  positive(problems, 'trainer.exit_interval', trainer.exit_interval, allow_zero=True)
  return problems


def _check_optim(config) -> list:
  """model.optim and its sched (optim/ checks both), every message under the model.optim key."""
  optim = config.model.optim
  return [f'model.optim: {msg}' if not msg.startswith('model.optim') else msg
          for msg in optimizers.check(optim) + schedules.check_schedule(optim.sched, config.trainer.max_steps)]


def warnings(config) -> list:
  """Settings that work but are probably not what the user meant."""
  out = []
  m, a = config.model, config.data
  if config.distributed_strategy.sequence_parallel and config.distributed_strategy.tensor_model_parallel_size == 1:
    out.append('distributed_strategy.sequence_parallel=True does nothing at tensor_model_parallel_size=1 (no TP '
               'group to split the sequence over): the run is the same without it, as in Megatron-LM')
  out += schedules.schedule_warnings(m.optim.sched, config.trainer.max_steps) + context.warnings(config)
  if m.position_embedding_type == 'rope' and a.seq_length > m.max_position_embeddings:
    out.append(f'data.seq_length={a.seq_length} exceeds model.max_position_embeddings='
               f'{m.max_position_embeddings}: RoPE extrapolates beyond the trained length')
  if m.optim.name == 'muon' and m.optim.muon.ns_dtype == 'bfloat16' and devices.kind(config.device) == 'cpu':
    out.append('model.optim.muon.ns_dtype=bfloat16 on the CPU: bf16 matmuls there are many times slower than fp32 '
               '(llama_50m: over 70 s a step, against 7-8 s in fp32); set ns_dtype=float32')
  return out


def validate(config, world_size=1):
  """Raise ConfigError listing every problem, or return the data-parallel size."""
  problems = check(config, world_size)
  if problems:
    raise ConfigError('invalid config ({} problem{}):\n  - {}'.format(
        len(problems), 's' * (len(problems) > 1), '\n  - '.join(problems)))
  return world_size // _model_parallel(config.distributed_strategy)


def _model_parallel(strategy):
  """Ranks per data-parallel replica: tp x pp x cp."""
  return (strategy.tensor_model_parallel_size * strategy.pipeline_model_parallel_size
          * strategy.context_parallel_size)
