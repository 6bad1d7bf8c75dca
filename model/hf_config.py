"""HF config.json <-> flatron's model section for Llama, Mistral, Qwen2 and Gemma 3 text.

Works with the config layouts of transformers 4.x (top-level `rope_theta`, `rope_scaling`,
Gemma's `rope_local_base_freq`) and 5.x (`rope_parameters`, per layer type for Gemma 3). Keys a
family has that flatron does not implement are refused by name, never ignored.
"""
import copy

from model import rope, transformer

FAMILIES = {                      # HF model_type -> (its causal-LM class, our model.architecture label)
    'llama': ('LlamaForCausalLM', 'llama'),
    'mistral': ('MistralForCausalLM', 'mistral'),
    'qwen2': ('Qwen2ForCausalLM', 'qwen2'),
    'gemma3_text': ('Gemma3ForCausalLM', 'gemma3'),
    'mixtral': ('MixtralForCausalLM', 'mixtral'),
    'qwen2_moe': ('Qwen2MoeForCausalLM', 'qwen2_moe'),
}
MOE_FAMILIES = ('mixtral', 'qwen2_moe')
ACTIVATIONS = {'silu': 'swiglu', 'gelu_pytorch_tanh': 'geglu'}   # HF hidden_act -> ours
# Gemma's block: all of these together, and only in gemma3_text
GEMMA_KEYS = ('rmsnorm_unit_offset', 'qk_norm', 'sandwich_norm', 'scale_embeddings')


# --- config -----------------------------------------------------------------------------


def _layer_types(hf, family, num_layers):
  """(sliding window or 0, per-layer attention types) as HF's config classes derive them."""
  window = hf.get('sliding_window', 4096) or 0       # 4096: Mistral's and Qwen2's class default
  if family in ('qwen2', 'qwen2_moe') and not hf.get('use_sliding_window'):
    window = 0
  types = hf.get('layer_types')
  if not types and family == 'gemma3_text':
    pattern = hf.get('sliding_window_pattern', hf.get('_sliding_window_pattern', 6))
    types = ['sliding_attention' if (i + 1) % pattern else 'full_attention' for i in range(num_layers)]
  if not types and family in ('qwen2', 'qwen2_moe') and window:
    first = hf.get('max_window_layers', num_layers)
    types = ['sliding_attention' if i >= first else 'full_attention' for i in range(num_layers)]
  if family in ('llama', 'mistral') and types:
    raise ValueError(f'layer_types={types}: per-layer attention types are not part of HF {family}')
  types = tuple(types or ())
  unknown = sorted(set(types) - {'full_attention', 'sliding_attention'})
  if unknown:
    raise ValueError(f'layer_types has {unknown}: only full_attention and sliding_attention are supported')
  if len(types) not in (0, num_layers):
    raise ValueError(f'layer_types has {len(types)} entries for {num_layers} layers')
  if 'sliding_attention' not in types and family not in ('mistral', 'mixtral'):
    window, types = 0, ()
  return int(window), types


def _refuse(hf, unsupported):
  """Keys whose set values change the model in ways flatron does not implement."""
  for key, allowed in unsupported.items():
    if hf.get(key) not in allowed:
      raise ValueError(f'{key}={hf[key]!r} is not supported (flatron implements {allowed[0]!r})')


def config_from_hf(hf_config: dict, base_model):
  """A copy of the `model` config section `base_model` with what an HF config dict (Llama,
  Mistral, Qwen2 or Gemma 3 text) sets.

  Keys HF has no counterpart for (optim, dropouts other than attention, fusions...) keep
  `base_model`'s values.
  """
  hf = hf_config
  family = hf.get('model_type')
  if family not in FAMILIES:
    if 'LlamaForCausalLM' not in (hf.get('architectures') or []):
      hint = ' (a Gemma 3 vision-language config: import its text model, Gemma3ForCausalLM)' \
          if family == 'gemma3' else ''
      raise ValueError(f"model_type={family!r}, architectures={hf.get('architectures')}: only "
                       f"{', '.join(FAMILIES)} can be imported{hint}")
    family = 'llama'
  gemma = family == 'gemma3_text'
  act = hf.get('hidden_activation' if gemma else 'hidden_act', 'gelu_pytorch_tanh' if gemma else 'silu')
  if act != ('gelu_pytorch_tanh' if gemma else 'silu'):
    raise ValueError(f"{'hidden_activation' if gemma else 'hidden_act'}={act!r} is not supported for {family} "
                     f"(only {'gelu_pytorch_tanh' if gemma else 'silu'})")
  _refuse(hf, {'final_logit_softcapping': (None,), 'attn_logit_softcapping': (None,),
               'use_bidirectional_attention': (None, False)})
  attention_bias, mlp_bias = bool(hf.get('attention_bias', False)), bool(hf.get('mlp_bias', False))
  if attention_bias != mlp_bias:
    # Our single has_bias switch covers attention and MLP linears together.
    raise ValueError(f'attention_bias={attention_bias} differs from mlp_bias={mlp_bias}; '
                     'flatron supports biases in all linears or none')
  m = copy.deepcopy(base_model)
  m.architecture = FAMILIES[family][1]
  m.hidden_size = hf['hidden_size']
  m.ffn_hidden_size = hf['intermediate_size']
  m.num_layers = hf['num_hidden_layers']
  m.num_attention_heads = hf['num_attention_heads']
  m.num_kv_heads = hf.get('num_key_value_heads') or hf['num_attention_heads']
  head_dim = hf.get('head_dim') or (256 if gemma else None)
  # 0 means hidden / heads; HF 5.x always writes head_dim, even when it is the default.
  m.head_dim = head_dim if head_dim and head_dim * m.num_attention_heads != m.hidden_size else 0
  m.vocab_size = hf['vocab_size']
  m.max_position_embeddings = hf.get('max_position_embeddings', 2048)
  m.position_embedding_type = 'rope'
  m.rope_theta, scaling, m.rope_local_theta, m.rotary_percentage = rope.from_hf(hf)
  m.rope_scaling.update(scaling)
  m.sliding_window, m.layer_types = _layer_types(hf, family, m.num_layers)
  m.normalization = 'rmsnorm'
  m.layernorm_epsilon = float(hf.get('rms_norm_eps', 1e-6))
  m.activation = ACTIVATIONS[act]
  m.has_bias = attention_bias
  m.qkv_bias = family == 'qwen2' or (family == 'qwen2_moe' and bool(hf.get('qkv_bias', True)))  # q, k, v only
  _moe_from_hf(hf, family, m)
  for key in GEMMA_KEYS:
    m[key] = gemma
  m.query_pre_attn_scalar = int(hf.get('query_pre_attn_scalar', 256)) if gemma else 0
  m.share_embeddings_and_output_weights = bool(hf.get('tie_word_embeddings', gemma))
  m.attention_dropout = float(hf.get('attention_dropout', 0.0))
  m.init_method_std = float(hf.get('initializer_range', m.init_method_std))
  return m


def _moe_from_hf(hf, family, m):
  """model.moe from Mixtral's / Qwen2-MoE's keys (HF routes every token: dropless)."""
  moe = m.moe
  moe.num_experts = 0
  if family not in MOE_FAMILIES:
    return
  if hf.get('router_jitter_noise'):
    raise ValueError(f'router_jitter_noise={hf["router_jitter_noise"]} is not supported (flatron implements 0)')
  if hf.get('mlp_only_layers'):
    raise ValueError(f'mlp_only_layers={hf["mlp_only_layers"]} is not supported (dense layers by '
                     'decoder_sparse_step only)')
  mixtral = family == 'mixtral'
  moe.num_experts = hf['num_local_experts' if mixtral else 'num_experts']
  moe.top_k = hf.get('num_experts_per_tok', 2 if mixtral else 4)
  moe.frequency = 1 if mixtral else hf.get('decoder_sparse_step', 1)
  moe.normalize_top_k_affinities = True if mixtral else bool(hf.get('norm_topk_prob', False))
  moe.dropless, moe.routing_algorithm, moe.router_activation = True, 'top_k', 'softmax'
  moe.output_router_logits = bool(hf.get('output_router_logits', False))
  moe.router_aux_loss_coef = float(hf.get('router_aux_loss_coef', 0.001))
  moe.ffn_hidden_size = 0 if mixtral else hf['moe_intermediate_size']
  moe.shared_expert_intermediate_size = 0 if mixtral else hf['shared_expert_intermediate_size']


def _moe_family(m) -> str:
  """mixtral or qwen2_moe for a model section with experts, or an error naming what neither can."""
  moe = m.moe
  if moe.routing_algorithm != 'top_k' or moe.router_activation != 'softmax' or moe.dropout:
    raise ValueError('model.moe: HF routes top_k with softmax, no expert dropout')
  if not moe.dropless:
    raise ValueError('model.moe.dropless=False: HF Mixtral / Qwen2-MoE never drop tokens; export with '
                     'model.moe.dropless=True (the capacity is a training-time setting)')
  if moe.shared_expert_intermediate_size:
    if m.has_bias:
      raise ValueError('model.has_bias: HF Qwen2-MoE has biases on q, k, v only (model.qkv_bias)')
    return 'qwen2_moe'
  if m.get('qkv_bias') or m.has_bias or moe.frequency != 1 or not moe.normalize_top_k_affinities \
      or moe.ffn_hidden_size not in (0, m.ffn_hidden_size):
    raise ValueError('model.moe without a shared expert is HF Mixtral: no biases, moe.frequency=1, '
                     'normalize_top_k_affinities=True, moe.ffn_hidden_size=0 (set '
                     'moe.shared_expert_intermediate_size for Qwen2-MoE)')
  return 'mixtral'


def _family(m) -> str:
  """The HF model_type that expresses model section `m`, or an error naming what none can."""
  if m.get('moe') and m.moe.num_experts > 0:
    return _moe_family(m)
  gemma = [m.get(key) for key in GEMMA_KEYS] + [m.activation == 'geglu']
  if any(gemma) and not all(gemma):
    raise ValueError(f'model.{"/".join(GEMMA_KEYS)} and activation=geglu are HF Gemma 3 together; '
                     'a subset cannot be expressed in any HF family flatron exports')
  if all(gemma):
    if m.has_bias or m.get('qkv_bias'):
      raise ValueError('Gemma 3 has no biases: unset model.has_bias / model.qkv_bias')
    return 'gemma3_text'
  if m.activation != 'swiglu':
    raise ValueError(f'model.activation={m.activation!r} cannot be expressed in HF Llama/Mistral/Qwen2 (needs swiglu)')
  if m.get('rope_local_theta') or m.get('query_pre_attn_scalar'):
    raise ValueError('model.rope_local_theta / query_pre_attn_scalar are expressible in HF Gemma 3 only')
  mixed = len(set(transformer.layer_types(m))) > 1
  if m.get('qkv_bias'):
    if m.has_bias:
      raise ValueError('model.qkv_bias with model.has_bias: biases everywhere already include q, k, v')
    return 'qwen2'
  if mixed:
    raise ValueError(f'model.layer_types={tuple(m.layer_types)} mixes full and sliding layers: HF Llama and Mistral '
                     'cannot express that (Qwen2 can, with model.qkv_bias; Gemma 3 with its block)')
  return 'mistral' if m.get('sliding_window') or m.architecture == 'mistral' else 'llama'


def config_to_hf(model_cfg) -> dict:
  """An HF config dict (Llama, Mistral, Qwen2 or Gemma 3 text, whichever expresses the model
  section); errors for what none can express.

  hidden_dropout / ffn_dropout are training-only regularizers HF lacks: not exported.
  Query-key layer scaling is exact in fp32 (it divides and multiplies back), so it needs nothing.
  """
  m = model_cfg
  unsupported = {
      'position_embedding_type': (m.position_embedding_type, 'rope'),
      'normalization': (m.normalization, 'rmsnorm'),
      'rotary_percentage': (m.rotary_percentage, 1.0),
  }
  for key, (value, needed) in unsupported.items():
    if value != needed:
      raise ValueError(f'model.{key}={value!r} cannot be expressed in HF (needs {needed!r})')
  family = _family(m)
  rope_scaling = rope.to_hf(m)
  out = {
      'architectures': [FAMILIES[family][0]],
      'model_type': family,
      'hidden_size': m.hidden_size,
      'intermediate_size': m.ffn_hidden_size,
      'num_hidden_layers': m.num_layers,
      'num_attention_heads': m.num_attention_heads,
      'num_key_value_heads': transformer.kv_heads(m),
      'head_dim': transformer.head_dim(m),
      'vocab_size': m.vocab_size,
      'max_position_embeddings': m.max_position_embeddings,
      'rms_norm_eps': m.layernorm_epsilon,
      'attention_bias': m.has_bias,
      'attention_dropout': m.attention_dropout,
      'tie_word_embeddings': m.share_embeddings_and_output_weights,
      'initializer_range': m.init_method_std,
      'use_cache': True,
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
  out.update(hidden_act='silu', mlp_bias=m.has_bias,
             # both layouts: transformers 4.x reads rope_theta, 5.x rope_parameters
             rope_theta=m.rope_theta, rope_scaling=rope_scaling,
             rope_parameters=dict(rope_scaling or {'rope_type': 'default'}, rope_theta=m.rope_theta))
  if family == 'llama':
    out['pretraining_tp'] = 1
  if family in ('mistral', 'mixtral'):
    out['sliding_window'] = window or None
  if family in MOE_FAMILIES:
    moe = m.moe
    out.update(num_experts_per_tok=moe.top_k, output_router_logits=moe.output_router_logits,
               router_aux_loss_coef=moe.router_aux_loss_coef, router_jitter_noise=0.0)
    if family == 'mixtral':
      out['num_local_experts'] = moe.num_experts
    else:
      out.update(num_experts=moe.num_experts, decoder_sparse_step=moe.frequency, mlp_only_layers=[],
                 norm_topk_prob=moe.normalize_top_k_affinities, qkv_bias=bool(m.get('qkv_bias')),
                 moe_intermediate_size=moe.ffn_hidden_size or m.ffn_hidden_size,
                 shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
  if family in ('qwen2', 'qwen2_moe'):
    types = list(transformer.layer_types(m))
    # Older readers take the layers from max_window_layers on as sliding (5.x reads layer_types)
    first_sliding = types.index('sliding_attention') if 'sliding_attention' in types else m.num_layers
    out.update(use_sliding_window=bool(window), sliding_window=window or None,
               max_window_layers=first_sliding, layer_types=types)
  return out
