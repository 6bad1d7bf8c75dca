"""What the model section may hold: the architecture knobs transformer.py and layers.py read.

Only the model's own rules live here; how a layout splits it (tp, pp) is parallel/'s check,
recompute is parallel/remat.py's. configs/validate.py reports these with every other problem.
"""
from config_checks import one_of, positive
from model import moe_checks, rope

ARCHITECTURES = ('llama', 'gpt', 'mistral', 'qwen2', 'qwen3', 'olmo2', 'smollm3', 'phi3', 'gemma3', 'mixtral', 'qwen2_moe',
                 'qwen3_moe', 'gpt_oss', 'deepseek_v3', 'llama4')
NORMALIZATIONS = ('rmsnorm', 'layernorm')
ACTIVATIONS = ('swiglu', 'geglu', 'gelu')
POSITIONS = ('rope', 'learned_absolute')
ROPE_SCALINGS = ('none', 'linear', 'dynamic', 'llama3', 'yarn', 'longrope')
LAYER_TYPES = ('full_attention', 'sliding_attention', 'chunked_attention')
POSITIVE_KEYS = ('num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads', 'vocab_size',
                 'max_position_embeddings', 'make_vocab_size_divisible_by', 'init_method_std',
                 'layernorm_epsilon', 'rope_theta')


def check(model, seq_length) -> list:
  """Every problem in model section `model` for sequences of `seq_length` (data.seq_length)."""
  problems = []
  one_of(problems, 'model.architecture', model.architecture, ARCHITECTURES)
  one_of(problems, 'model.normalization', model.normalization, NORMALIZATIONS)
  one_of(problems, 'model.activation', model.activation, ACTIVATIONS)
  one_of(problems, 'model.position_embedding_type', model.position_embedding_type, POSITIONS)
  for key in POSITIVE_KEYS:
    positive(problems, f'model.{key}', model[key])
  heads, kv = model.num_attention_heads, model.num_kv_heads or model.num_attention_heads
  if model.head_dim == 0 and heads > 0 and model.hidden_size % heads:
    problems.append(f'model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads={heads}; '
                    'change one or set model.head_dim')
  positive(problems, 'model.num_kv_heads', model.num_kv_heads, allow_zero=True)
  if heads > 0 and kv > 0 and heads % kv:
    problems.append(f'model.num_kv_heads={model.num_kv_heads} must divide model.num_attention_heads={heads} '
                    '(0 means num_attention_heads)')
  if model.get('mla') is not None and model.mla.kv_lora_rank > 0 and kv != heads:
    problems.append(f'model.num_kv_heads={model.num_kv_heads} with latent attention (model.mla): every head expands '
                    f'its own key and value from the latent (transformers repeats them otherwise); set num_kv_heads='
                    f'{heads} or 0')
  problems += _check_positions(model) + moe_checks.check(model)
  if (model.rmsnorm_unit_offset or model.qk_norm or model.sandwich_norm) and model.normalization != 'rmsnorm':
    problems.append(f'model.rmsnorm_unit_offset / qk_norm / sandwich_norm need model.normalization=rmsnorm '
                    f'(got {model.normalization!r})')
  one_of(problems, 'model.qk_norm_span', model.qk_norm_span, ('head', 'projection'))
  outside = [i for i in model.nope_layers if not 0 <= i < model.num_layers]
  if outside:
    problems.append(f'model.nope_layers has {outside}, outside the model\'s layers 0-{model.num_layers - 1}')
  if model.qkv_bias and model.has_bias:
    problems.append('model.qkv_bias=True with model.has_bias=True: biases everywhere already include q, k, v; '
                    'set one of them')
  if not 0.0 < model.rotary_percentage <= 1.0:
    problems.append(f'model.rotary_percentage={model.rotary_percentage} must be in (0, 1]')
  for key in ('hidden_dropout', 'attention_dropout', 'ffn_dropout'):
    if not 0.0 <= model[key] < 1.0:
      problems.append(f'model.{key}={model[key]} must be in [0, 1)')
  chunk = model.fusions.chunked_cross_entropy
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    problems.append(f'model.fusions.chunked_cross_entropy={chunk!r} must be a whole number of tokens per '
                    'chunk (e.g. 1024), or 0 for the unchunked head and loss')
  if model.position_embedding_type == 'learned_absolute' and seq_length > model.max_position_embeddings:
    problems.append(f'data.seq_length={seq_length} exceeds model.max_position_embeddings='
                    f'{model.max_position_embeddings} (learned positions); raise max_position_embeddings')
  return problems


def _check_positions(model) -> list:
  """RoPE scaling, sliding windows and the per-layer attention kinds."""
  problems, scaling = [], model.rope_scaling
  one_of(problems, 'model.rope_scaling.type', scaling.type, ROPE_SCALINGS)
  if scaling.type != 'none':
    positive(problems, 'model.rope_scaling.factor', scaling.factor)
  if scaling.type == 'llama3' and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
    problems.append(f'model.rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor '
                    f'(got {scaling.low_freq_factor}, {scaling.high_freq_factor})')
  if scaling.type in rope.ORIGINAL_CONTEXT_TYPES:
    positive(problems, 'model.rope_scaling.original_max_position_embeddings', scaling.original_max_position_embeddings)
  if scaling.type in ('yarn', 'longrope'):
    positive(problems, 'model.rope_scaling.attention_factor', scaling.attention_factor, allow_zero=True)
  if scaling.type == 'yarn':
    for key in ('mscale', 'mscale_all_dim'):
      positive(problems, f'model.rope_scaling.{key}', scaling[key], allow_zero=True)
    if not 0 < scaling.beta_slow <= scaling.beta_fast:
      problems.append(f'model.rope_scaling: yarn needs 0 < beta_slow <= beta_fast (got {scaling.beta_slow}, '
                      f'{scaling.beta_fast}; HF: 1, 32)')
  if scaling.type == 'longrope':
    heads = model.num_attention_heads
    head_dim = model.head_dim or (model.hidden_size // heads if heads > 0 else 0)
    rot_dim = int(head_dim * model.rotary_percentage) // 2 * 2       # as transformer.py rotates
    problems += rope.longrope_problems(scaling, rot_dim, 'model.rope_scaling')
    if not all(f > 0 for f in tuple(scaling.short_factor) + tuple(scaling.long_factor)):
      problems.append("model.rope_scaling: longrope's short_factor and long_factor must be > 0 "
                      '(they divide the frequencies)')
  positive(problems, 'model.sliding_window', model.sliding_window, allow_zero=True)
  positive(problems, 'model.rope_local_theta', model.rope_local_theta, allow_zero=True)
  positive(problems, 'model.query_pre_attn_scalar', model.query_pre_attn_scalar, allow_zero=True)
  if model.layer_types:
    for kind in model.layer_types:
      one_of(problems, 'model.layer_types', kind, LAYER_TYPES)
    if len(model.layer_types) != model.num_layers:
      problems.append(f'model.layer_types has {len(model.layer_types)} entries for model.num_layers='
                      f'{model.num_layers} layers; give one per layer (or () for all alike)')
    if 'sliding_attention' in model.layer_types and not model.sliding_window:
      problems.append('model.layer_types has sliding_attention layers but model.sliding_window=0; set the window')
    if 'chunked_attention' in model.layer_types and model.get('attention_chunk_size', 0) <= 0:
      problems.append('model.layer_types has chunked_attention layers but model.attention_chunk_size=0; set the chunk')
  return problems
