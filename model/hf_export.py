"""flatron's model section -> an HF config.json: the family that expresses it (one of
model/hf_config.py's FAMILIES), or an error naming what none can."""
from model import mla, param_table, rope, transformer
from model.hf_config import FAMILIES, MOE_FAMILIES, WINDOW_EVERYWHERE


def _mixed(m) -> bool:
  return len(set(transformer.layer_types(m))) > 1


def _biases(m, family, allowed=('has_bias', 'qkv_bias')):
  """Refuses the bias switches HF `family` has no counterpart for."""
  for key in ('has_bias', 'qkv_bias'):
    if m.get(key) and key not in allowed:
      raise ValueError(f'model.{key}=True: HF {family} has no such biases; unset it')


GPT_OSS_KEYS = ('has_bias', 'attention_sinks', 'rmsnorm_scale_in_fp32')


def _moe_family(m) -> str:
  """mixtral, qwen2_moe, qwen3_moe or gpt_oss for a model section with experts, or an error naming what none can."""
  moe = m.moe
  if moe.routing_algorithm != 'top_k' or moe.dropout:
    raise ValueError('model.moe: HF routes top_k, no expert dropout')
  if not moe.dropless:
    raise ValueError('model.moe.dropless=False: HF Mixtral / Qwen-MoE never drop tokens; export with '
                     'model.moe.dropless=True (the capacity is a training-time setting)')
  if moe.get('scale_expert_input') or m.get('qk_l2_norm') or m.get('rope_interleave') or m.get('attention_chunk_size'):
    width = moe.ffn_hidden_size or m.ffn_hidden_size
    if not (moe.get('scale_expert_input') and moe.router_activation == 'sigmoid' and not moe.normalize_top_k_affinities
            and not moe.get('shared_expert_gate', True) and moe.shared_expert_intermediate_size == width
            and m.get('rope_interleave')) or moe.frequency != 1 or m.has_bias or m.get('qkv_bias') or \
        m.get('qk_norm') or m.get('sliding_window') or mla.enabled(m) or moe.get('load_balance_bias') or \
        moe.get('num_groups', 1) > 1 or moe.get('routed_scaling_factor', 1.0) != 1.0:
      raise ValueError('moe.scale_expert_input, a sigmoid router without renormalization, an ungated shared expert as '
                       'wide as the routed ones and model.rope_interleave are HF Llama 4 together (with its '
                       'qk_l2_norm, chunked and NoPE layers as it sets them); a subset cannot be expressed in any '
                       'HF family flatron exports')
    return 'llama4_text'
  if mla.enabled(m) or moe.get('load_balance_bias') or moe.get('num_groups', 1) > 1 or not moe.get('shared_expert_gate', True):
    dense = tuple(moe.get('dense_layers', ()))
    if not (mla.enabled(m) and moe.get('load_balance_bias') and not moe.get('shared_expert_gate', True)
            and moe.router_activation == 'sigmoid') or dense != tuple(range(len(dense))) or moe.frequency != 1 or \
        m.has_bias or m.get('qkv_bias') or m.get('qk_norm') or m.get('sliding_window') or \
        moe.shared_expert_intermediate_size % (moe.ffn_hidden_size or m.ffn_hidden_size):
      raise ValueError('model.mla, moe.load_balance_bias, moe.router_activation=sigmoid and a shared expert without '
                       'a gate (moe.shared_expert_gate=False) are HF DeepSeek-V3 together (with its first layers '
                       'dense, moe.frequency=1, no biases, no q/k norms, no sliding window, a shared width that is a '
                       'whole number of experts); a subset cannot be expressed in any HF family flatron exports')
    return 'deepseek_v3'
  if moe.router_activation != 'softmax':
    raise ValueError('model.moe.router_activation=sigmoid: HF routes with softmax but in DeepSeek-V3')
  if any(m.get(k) for k in GPT_OSS_KEYS) or moe.get('expert_activation') == 'clamped_swiglu':
    if not all(m.get(k) for k in GPT_OSS_KEYS) or moe.get('expert_activation') != 'clamped_swiglu' or \
        m.get('qk_norm') or m.get('qkv_bias') or moe.shared_expert_intermediate_size or moe.frequency != 1 or \
        moe.get('dense_layers') or not moe.normalize_top_k_affinities or \
        moe.ffn_hidden_size not in (0, m.ffn_hidden_size):
      raise ValueError('model.has_bias, attention_sinks, rmsnorm_scale_in_fp32 and moe.expert_activation='
                       'clamped_swiglu with experts are HF gpt-oss together (with moe.frequency=1, no dense '
                       'layers, normalize_top_k_affinities=True, no shared expert, no q/k norms); a subset cannot '
                       'be expressed in any HF family flatron exports')
    return 'gpt_oss'
  if moe.shared_expert_intermediate_size:
    if m.has_bias or m.get('qk_norm'):
      raise ValueError('model.has_bias / qk_norm: HF Qwen2-MoE has biases on q, k, v only (model.qkv_bias) '
                       'and no q/k norms')
    return 'qwen2_moe'
  if m.get('qk_norm'):
    if m.get('qk_norm_span', 'head') != 'head' or any(m.get(k) for k in ('rmsnorm_unit_offset', 'sandwich_norm',
                                                                         'post_norms_only', 'rmsnorm_scale_in_fp32')):
      raise ValueError('model.qk_norm with experts is HF Qwen3-MoE: per-head q/k norms (qk_norm_span=head), '
                       'Llama\'s pre-norm block')
    _biases(m, 'qwen3_moe', allowed=())
    if _mixed(m):
      raise ValueError(f'model.layer_types={tuple(m.layer_types)}: HF Qwen3-MoE slides every layer or none')
    return 'qwen3_moe'
  if m.get('qkv_bias') or m.has_bias or moe.frequency != 1 or moe.get('dense_layers') or \
      not moe.normalize_top_k_affinities or moe.ffn_hidden_size not in (0, m.ffn_hidden_size):
    raise ValueError('model.moe without a shared expert or q/k norms is HF Mixtral: no biases, moe.frequency=1, '
                     'no moe.dense_layers, normalize_top_k_affinities=True, moe.ffn_hidden_size=0 (set '
                     'moe.shared_expert_intermediate_size for Qwen2-MoE, model.qk_norm for Qwen3-MoE)')
  return 'mixtral'


def _gemma_or_olmo2(m):
  """gemma3_text or olmo2 where the model section has their block's keys (all of them), else None."""
  gemma = [m.get(k) for k in ('rmsnorm_unit_offset', 'sandwich_norm', 'scale_embeddings')] + [m.activation == 'geglu']
  if any(gemma):
    if not all(gemma) or not m.get('qk_norm') or m.get('qk_norm_span', 'head') != 'head':
      raise ValueError('model.rmsnorm_unit_offset / sandwich_norm / scale_embeddings / qk_norm (per head) and '
                       'activation=geglu are HF Gemma 3 together; a subset cannot be expressed in any HF family '
                       'flatron exports')
    _biases(m, 'gemma3_text', allowed=())
    return 'gemma3_text'
  projection = m.get('qk_norm') and m.get('qk_norm_span', 'head') == 'projection'
  olmo = [m.get('post_norms_only'), m.get('rmsnorm_scale_in_fp32'), projection]
  if any(olmo):
    if not all(olmo):
      raise ValueError('model.post_norms_only, rmsnorm_scale_in_fp32 and qk_norm with qk_norm_span=projection '
                       'are HF OLMo 2 together; a subset cannot be expressed in any HF family flatron exports')
    _biases(m, 'olmo2', allowed=())
    return 'olmo2'
  return None


def family_of(m) -> str:
  """The HF model_type that expresses model section `m`, or an error naming what none can."""
  if m.get('moe') and m.moe.num_experts > 0:
    return _moe_family(m)
  special = _gemma_or_olmo2(m)
  if special:
    return special
  if m.activation != 'swiglu':
    raise ValueError(f'model.activation={m.activation!r} cannot be expressed in HF Llama/Mistral/Qwen/Phi-3 (needs swiglu)')
  if m.get('rope_local_theta') or m.get('query_pre_attn_scalar'):
    raise ValueError('model.rope_local_theta / query_pre_attn_scalar are expressible in HF Gemma 3 only')
  if m.has_bias and m.get('qkv_bias'):
    raise ValueError('model.qkv_bias with model.has_bias: biases everywhere already include q, k, v')
  if m.get('nope_layers'):
    if m.get('qk_norm'):
      raise ValueError('model.nope_layers with model.qk_norm: HF SmolLM3 (the family without RoPE in some layers) '
                       'has no q/k norms')
    _biases(m, 'smollm3', allowed=('has_bias',))
    return 'smollm3'
  if m.get('qk_norm'):
    _biases(m, 'qwen3', allowed=())
    return 'qwen3'
  if m.architecture == 'phi3' or m.rotary_percentage != 1.0:
    _biases(m, 'phi3', allowed=())
    if _mixed(m):
      raise ValueError(f'model.layer_types={tuple(m.layer_types)}: HF Phi-3 slides every layer or none')
    return 'phi3'
  if m.get('qkv_bias'):
    return 'qwen2'
  if _mixed(m):
    raise ValueError(f'model.layer_types={tuple(m.layer_types)} mixes full and sliding layers: HF Llama and Mistral '
                     'cannot express that (Qwen2 can, with model.qkv_bias; Qwen3 with qk_norm; Gemma 3 with its block)')
  return 'mistral' if m.get('sliding_window') or m.architecture == 'mistral' else 'llama'


def _windows(m, family) -> dict:
  """The sliding-window keys of `family` for the model's per-layer attention kinds."""
  window, types = m.get('sliding_window') or 0, list(transformer.layer_types(m))
  if family == 'gpt_oss':
    return {'sliding_window': window or None, 'layer_types': types}
  if family in WINDOW_EVERYWHERE:
    out = {'sliding_window': window or None}
    return dict(out, use_sliding_window=bool(window)) if family == 'qwen3_moe' else out
  if family in ('qwen2', 'qwen2_moe', 'qwen3', 'smollm3'):
    # Older readers take the layers from max_window_layers on as sliding (5.x reads layer_types)
    first_sliding = types.index('sliding_attention') if 'sliding_attention' in types else m.num_layers
    out = dict(use_sliding_window=bool(window), sliding_window=window or None, layer_types=types)
    return out if family == 'smollm3' else dict(out, max_window_layers=first_sliding)
  return {}


def config_to_hf(model_cfg) -> dict:
  """An HF config dict (whichever of FAMILIES expresses the model section); errors for what
  none can express.

  hidden_dropout / ffn_dropout are training-only regularizers HF lacks: not exported.
  Query-key layer scaling is exact in fp32 (it divides and multiplies back), so it needs nothing.
  """
  m = model_cfg
  for key, value, needed in (('position_embedding_type', m.position_embedding_type, 'rope'),
                             ('normalization', m.normalization, 'rmsnorm')):
    if value != needed:
      raise ValueError(f'model.{key}={value!r} cannot be expressed in HF (needs {needed!r})')
  family = family_of(m)
  if m.rotary_percentage != 1.0 and family != 'phi3':
    raise ValueError(f'model.rotary_percentage={m.rotary_percentage}: of the HF families flatron exports only '
                     f'Phi-3 rotates part of each head (this model is {family}); set it to 1.0')
  rope_scaling = rope.to_hf(m)
  out = {
      'architectures': [FAMILIES[family][0]],
      'model_type': family,
      'hidden_size': m.hidden_size,
      'intermediate_size': m.ffn_hidden_size,
      'num_hidden_layers': m.num_layers,
      'num_attention_heads': m.num_attention_heads,
      'num_key_value_heads': param_table.kv_heads(m),
      'head_dim': transformer.head_dim(m),
      'vocab_size': m.vocab_size,
      'max_position_embeddings': m.max_position_embeddings,
      'rms_norm_eps': m.layernorm_epsilon,
      'attention_bias': m.has_bias,
      'attention_dropout': m.attention_dropout,
      'tie_word_embeddings': m.share_embeddings_and_output_weights,
      'initializer_range': m.init_method_std,
      'use_cache': True,
      # unknown here (model/hf.py write_generation_files sets them): None, not the class defaults,
      # which name tokens of the family's released vocabulary (SmolLM3's pad 128004, Phi-3's 32000)
      'pad_token_id': None, 'bos_token_id': None, 'eos_token_id': None,
  }
  out.update(rope.to_hf_top_level(m))          # what transformers 4.x reads only at the top level
  window = m.get('sliding_window') or 0
  if family == 'gemma3_text':
    out.update(hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=m.query_pre_attn_scalar or
               transformer.head_dim(m), sliding_window=window or m.max_position_embeddings,
               layer_types=list(transformer.layer_types(m)), final_logit_softcapping=None,
               attn_logit_softcapping=None, use_bidirectional_attention=False,
               # both layouts: 5.x reads rope_parameters per layer type, 4.x the flat keys
               rope_parameters={'full_attention': dict(rope_scaling or {'rope_type': 'default'}, rope_theta=m.rope_theta),
                                'sliding_attention': {'rope_type': 'default',
                                                      'rope_theta': m.rope_local_theta or m.rope_theta}},
               rope_theta=m.rope_theta, rope_local_base_freq=m.rope_local_theta or m.rope_theta,
               rope_scaling=rope_scaling)
    return out
  parameters = dict(rope_scaling or {'rope_type': 'default'}, rope_theta=m.rope_theta)
  if m.rotary_percentage != 1.0:
    parameters['partial_rotary_factor'] = m.rotary_percentage
  out.update(hidden_act='silu', mlp_bias=m.has_bias,
             # both layouts: transformers 4.x reads rope_theta, 5.x rope_parameters
             rope_theta=m.rope_theta, rope_scaling=rope_scaling, rope_parameters=parameters)
  if family == 'llama':
    out['pretraining_tp'] = 1
  if family == 'smollm3':
    nope = set(m.nope_layers)
    out.update(no_rope_layers=[0 if i in nope else 1 for i in range(m.num_layers)], no_rope_layer_interval=4)
  if family in MOE_FAMILIES:
    moe = m.moe
    out.update(num_experts_per_tok=moe.top_k, output_router_logits=moe.output_router_logits,
               router_aux_loss_coef=moe.router_aux_loss_coef, router_jitter_noise=0.0)
    if family in ('mixtral', 'gpt_oss'):
      out['num_local_experts'] = moe.num_experts
    elif family not in ('deepseek_v3', 'llama4_text'):
      out.update(num_experts=moe.num_experts, decoder_sparse_step=moe.frequency,
                 mlp_only_layers=sorted(moe.get('dense_layers', ())), norm_topk_prob=moe.normalize_top_k_affinities,
                 moe_intermediate_size=moe.ffn_hidden_size or m.ffn_hidden_size)
    if family == 'gpt_oss':
      out.update(swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit)
      out.pop('mlp_bias')
    if family == 'llama4_text':
      nope, moe_layers = set(m.get('nope_layers', ())), [i for i in range(m.num_layers) if i not in moe.get('dense_layers', ())]
      out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size or m.ffn_hidden_size,
                 intermediate_size_mlp=m.ffn_hidden_size, moe_layers=moe_layers,
                 no_rope_layers=[0 if i in nope else 1 for i in range(m.num_layers)],
                 attention_chunk_size=m.get('attention_chunk_size') or None, use_qk_norm=bool(m.get('qk_l2_norm')),
                 attn_temperature_tuning=bool(m.get('attn_temperature_tuning')), floor_scale=m.attn_floor_scale,
                 attn_scale=m.attn_scale, layer_types=list(transformer.layer_types(m)))
      out.pop('mlp_bias')
    if family == 'deepseek_v3':
      width = moe.ffn_hidden_size or m.ffn_hidden_size
      out.update({k: m.mla[k] for k in ('kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')})
      out.update(q_lora_rank=m.mla.q_lora_rank or None, rope_interleave=m.mla.rope_interleave,
                 n_routed_experts=moe.num_experts, n_shared_experts=moe.shared_expert_intermediate_size // width,
                 moe_intermediate_size=width, n_group=moe.num_groups, topk_group=moe.top_k_groups,
                 routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.normalize_top_k_affinities,
                 first_k_dense_replace=len(moe.get('dense_layers', ())), head_dim=m.mla.qk_rope_head_dim)
      out.pop('mlp_bias')
    if family == 'qwen2_moe':
      out.update(qkv_bias=bool(m.get('qkv_bias')), shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
  out.update(_windows(m, family))
  return out
