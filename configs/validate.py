"""One up-front check of the whole config: every problem, each naming its key and the fix.

Runs before any process group or tensor exists, so a bad launch fails in a second with the
complete list instead of one error per attempt.
"""
from optim import optimizers, schedules
from parallel import precision

DEVICES = ('auto', 'cpu', 'cuda', 'xla')
NORMALIZATIONS = ('rmsnorm', 'layernorm')
ACTIVATIONS = ('swiglu', 'gelu')
POSITIONS = ('rope', 'learned_absolute')
ARCHITECTURES = ('llama', 'gpt')
RECOMPUTE_GRANULARITIES = (None, 'selective', 'full')
RECOMPUTE_PARTS = ('attention', 'mlp')
TOKENIZERS = ('none', 'sentencepiece', 'huggingface', 'gpt2')
NONFINITE_POLICIES = ('error', 'skip')


class ConfigError(ValueError):
  pass


def _one_of(problems, key, value, allowed):
  if value not in allowed:
    problems.append(f'{key}={value!r} is unknown; valid: {", ".join(map(str, allowed))}')


def _positive(problems, key, value, allow_zero=False):
  if value < 0 or (value == 0 and not allow_zero):
    problems.append(f'{key}={value} must be {">= 0" if allow_zero else "> 0"}')


def check(config, world_size=1) -> list:
  """Every problem in `config` for a run on `world_size` processes, as messages."""
  p = []
  c, m, d, a, t = config, config.model, config.distributed_strategy, config.data, config.trainer
  _one_of(p, 'device', c.device, DEVICES)

  # --- trainer
  _positive(p, 'trainer.max_steps', t.max_steps)
  _positive(p, 'trainer.log_every_n_steps', t.log_every_n_steps)
  _positive(p, 'trainer.val_check_interval', t.val_check_interval, allow_zero=True)
  _positive(p, 'trainer.limit_val_batches', t.limit_val_batches, allow_zero=True)
  _positive(p, 'trainer.num_sanity_val_steps', t.num_sanity_val_steps, allow_zero=True)
  _positive(p, 'trainer.gradient_clip_val', t.gradient_clip_val, allow_zero=True)
  _one_of(p, 'trainer.nonfinite_policy', t.nonfinite_policy, NONFINITE_POLICIES)
  _positive(p, 'trainer.max_consecutive_skips', t.max_consecutive_skips)
  _positive(p, 'trainer.exit_interval', t.exit_interval, allow_zero=True)

  # --- model
  _one_of(p, 'model.architecture', m.architecture, ARCHITECTURES)
  _one_of(p, 'model.normalization', m.normalization, NORMALIZATIONS)
  _one_of(p, 'model.activation', m.activation, ACTIVATIONS)
  _one_of(p, 'model.position_embedding_type', m.position_embedding_type, POSITIONS)
  for key in ('num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads', 'vocab_size',
              'max_position_embeddings', 'make_vocab_size_divisible_by', 'init_method_std',
              'layernorm_epsilon', 'rope_theta'):
    _positive(p, f'model.{key}', m[key])
  heads, kv = m.num_attention_heads, m.num_kv_heads or m.num_attention_heads
  if m.head_dim == 0 and heads > 0 and m.hidden_size % heads:
    p.append(f'model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={heads}; '
             'change one or set model.head_dim')
  if kv <= 0 or heads % kv:
    p.append(f'model.num_kv_heads={m.num_kv_heads} must divide model.num_attention_heads={heads} '
             '(0 means num_attention_heads)')
  if not 0.0 < m.rotary_percentage <= 1.0:
    p.append(f'model.rotary_percentage={m.rotary_percentage} must be in (0, 1]')
  for key in ('hidden_dropout', 'attention_dropout', 'ffn_dropout'):
    if not 0.0 <= m[key] < 1.0:
      p.append(f'model.{key}={m[key]} must be in [0, 1)')
  _one_of(p, 'model.activations_checkpoint_granularity', m.activations_checkpoint_granularity,
          RECOMPUTE_GRANULARITIES)
  for part in m.activations_checkpoint_recompute:
    _one_of(p, 'model.activations_checkpoint_recompute', part, RECOMPUTE_PARTS)
  if m.position_embedding_type == 'learned_absolute' and a.seq_length > m.max_position_embeddings:
    p.append(f'data.seq_length={a.seq_length} exceeds model.max_position_embeddings='
             f'{m.max_position_embeddings} (learned positions); raise max_position_embeddings')
  p += [f'model.optim: {msg}' if not msg.startswith('model.optim') else msg
        for msg in optimizers.check(m.optim) + schedules.check_schedule(m.optim.sched)]

  # --- parallel layout
  tp, pp, vp = (d.tensor_model_parallel_size, d.pipeline_model_parallel_size,
                d.virtual_pipeline_model_parallel_size)
  for key in ('tensor_model_parallel_size', 'pipeline_model_parallel_size',
              'virtual_pipeline_model_parallel_size', 'kv_replicator'):
    _positive(p, f'distributed_strategy.{key}', d[key])
  if min(tp, pp, vp, d.kv_replicator) <= 0:
    return p
  if world_size % (tp * pp):
    p.append(f'world size {world_size} is not divisible by tensor_model_parallel_size x '
             f'pipeline_model_parallel_size = {tp} x {pp}; launch a multiple of {tp * pp} processes')
  dp = max(1, world_size // (tp * pp))
  if heads % tp:
    p.append(f'model.num_attention_heads={heads} is not divisible by '
             f'distributed_strategy.tensor_model_parallel_size={tp}')
  if m.ffn_hidden_size % tp:
    p.append(f'model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by '
             f'distributed_strategy.tensor_model_parallel_size={tp}')
  if tp > kv:
    if kv * d.kv_replicator != tp:
      p.append(f'tensor_model_parallel_size={tp} > model.num_kv_heads={kv}: set '
               f'distributed_strategy.kv_replicator={tp // kv if tp % kv == 0 else "?"} so that '
               f'num_kv_heads x kv_replicator = tp (now {kv} x {d.kv_replicator})'
               + ('' if tp % kv == 0 else '; tp must be a multiple of num_kv_heads'))
  else:
    if kv % tp:
      p.append(f'model.num_kv_heads={kv} is not divisible by tensor_model_parallel_size={tp}')
    if d.kv_replicator != 1:
      p.append(f'distributed_strategy.kv_replicator={d.kv_replicator} needs tp > num_kv_heads '
               f'({tp} <= {kv}); set it to 1')
  if d.sequence_parallel and tp == 1:
    p.append('distributed_strategy.sequence_parallel=True needs tensor_model_parallel_size > 1; '
             'set sequence_parallel=False or raise tp')
  if d.sequence_parallel and a.seq_length % tp:
    p.append(f'data.seq_length={a.seq_length} is not divisible by tensor_model_parallel_size={tp} '
             '(needed by sequence_parallel)')
  if m.num_layers < pp * vp:
    p.append(f'model.num_layers={m.num_layers} < pipeline_model_parallel_size x '
             f'virtual_pipeline_model_parallel_size = {pp} x {vp}: every chunk needs a layer')
  elif vp > 1 and m.num_layers % (pp * vp):
    p.append(f'model.num_layers={m.num_layers} is not divisible by pp x virtual = {pp * vp} '
             '(interleaved schedules need equal chunks)')
  if d.pipeline_cuts:
    cuts = list(d.pipeline_cuts)
    if len(cuts) != pp * vp - 1 or cuts != sorted(set(cuts)) or not all(0 < x < m.num_layers for x in cuts):
      p.append(f'distributed_strategy.pipeline_cuts={tuple(cuts)} must be pp x virtual - 1 = '
               f'{pp * vp - 1} increasing layer indices in (0, {m.num_layers})')
  if vp > 1 and pp == 1:
    p.append(f'distributed_strategy.virtual_pipeline_model_parallel_size={vp} needs '
             'pipeline_model_parallel_size > 1 (interleaving splits a stage across PP ranks)')

  # --- data
  _positive(p, 'data.micro_batch_size', a.micro_batch_size)
  _positive(p, 'data.seq_length', a.seq_length)
  if a.micro_batch_size > 0 and a.global_batch_size % (a.micro_batch_size * dp):
    p.append(f'data.global_batch_size={a.global_batch_size} is not divisible by micro_batch_size x '
             f'data-parallel size = {a.micro_batch_size} x {dp}; use a multiple of '
             f'{a.micro_batch_size * dp}')
  _one_of(p, 'data.tokenizer.type', a.tokenizer.type, TOKENIZERS)
  if a.data_prefix and len(a.data_prefix) > 1 and len(a.data_prefix) % 2:
    p.append('data.data_prefix must be (prefix,) or (weight1, prefix1, weight2, prefix2, ...)')
  if not a.data_prefix and a.synthetic_vocab_size > m.vocab_size:
    p.append(f'data.synthetic_vocab_size={a.synthetic_vocab_size} exceeds model.vocab_size={m.vocab_size}')

  # --- precision and experiment manager
  p += precision.check(config.precision)
  e = config.exp_manager
  if e.checkpoint_callback_params.save_top_k == 0 or e.checkpoint_callback_params.save_top_k < -1:
    p.append(f'exp_manager.checkpoint_callback_params.save_top_k={e.checkpoint_callback_params.save_top_k} '
             'must be > 0 (steps kept) or -1 (keep all)')
  _positive(p, 'exp_manager.checkpoint_callback_params.every_n_train_steps',
            e.checkpoint_callback_params.every_n_train_steps, allow_zero=True)
  return p


def warnings(config) -> list:
  """Settings that work but are probably not what the user meant."""
  out = []
  m, a = config.model, config.data
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
