"""HF config.json -> flatron's model section for Llama, Mistral, Qwen2, Qwen3, OLMo 2, SmolLM3,
Phi-3, Gemma 3 text, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and DeepSeek-V3 (the other way:
model/hf_export.py).

Works with the config layouts of transformers 4.x (top-level `rope_theta`, `rope_scaling`,
Gemma's `rope_local_base_freq`) and 5.x (`rope_parameters`, per layer type for Gemma 3). Keys a
family has that flatron does not implement are refused by name, never ignored.
"""
import copy

from model import rope

FAMILIES = {                      # HF model_type -> (its causal-LM class, our model.architecture label)
    'llama': ('LlamaForCausalLM', 'llama'),
    'mistral': ('MistralForCausalLM', 'mistral'),
    'qwen2': ('Qwen2ForCausalLM', 'qwen2'),
    'qwen3': ('Qwen3ForCausalLM', 'qwen3'),
    'olmo2': ('Olmo2ForCausalLM', 'olmo2'),
    'smollm3': ('SmolLM3ForCausalLM', 'smollm3'),
    'phi3': ('Phi3ForCausalLM', 'phi3'),
    'gemma3_text': ('Gemma3ForCausalLM', 'gemma3'),
    'mixtral': ('MixtralForCausalLM', 'mixtral'),
    'qwen2_moe': ('Qwen2MoeForCausalLM', 'qwen2_moe'),
    'qwen3_moe': ('Qwen3MoeForCausalLM', 'qwen3_moe'),
    'gpt_oss': ('GptOssForCausalLM', 'gpt_oss'),
    'deepseek_v3': ('DeepseekV3ForCausalLM', 'deepseek_v3'),
    'llama4_text': ('Llama4ForCausalLM', 'llama4'),
}
MOE_FAMILIES = ('mixtral', 'qwen2_moe', 'qwen3_moe', 'gpt_oss', 'deepseek_v3', 'llama4_text')
MLA_KEYS = ('kv_lora_rank', 'q_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')
ACTIVATIONS = {'silu': 'swiglu', 'gelu_pytorch_tanh': 'geglu'}   # HF hidden_act -> ours
# Gemma's block: all of these together, and only in gemma3_text
GEMMA_KEYS = ('rmsnorm_unit_offset', 'qk_norm', 'sandwich_norm', 'scale_embeddings')
# OLMo 2's block: norms after attention and the MLP only, scaled in fp32, q/k norms over the projection
OLMO2_KEYS = ('post_norms_only', 'rmsnorm_scale_in_fp32', 'qk_norm')
# Sliding layers from max_window_layers on (Qwen2's and Qwen3's dense configs)
WINDOW_FROM_LAYER = ('qwen2', 'qwen2_moe', 'qwen3')
# One sliding window for every layer when set (Mistral's way)
WINDOW_EVERYWHERE = ('mistral', 'mixtral', 'phi3', 'qwen3_moe')


# --- config -----------------------------------------------------------------------------


def _layer_types(hf, family, num_layers, nope_layers):
  """(sliding window or 0, per-layer attention types) as HF's config classes derive them."""
  default = 4096 if family in ('mistral', 'mixtral', 'qwen2', 'qwen2_moe') else None   # the class defaults
  window = hf.get('sliding_window', default) or 0
  if family in WINDOW_FROM_LAYER + ('qwen3_moe', 'smollm3') and not hf.get('use_sliding_window'):
    window = 0
  types = hf.get('layer_types')
  if not types and family == 'gemma3_text':
    pattern = hf.get('sliding_window_pattern', hf.get('_sliding_window_pattern', 6))
    types = ['sliding_attention' if (i + 1) % pattern else 'full_attention' for i in range(num_layers)]
  if not types and family in WINDOW_FROM_LAYER and window:
    first = hf.get('max_window_layers', num_layers)
    types = ['sliding_attention' if i >= first else 'full_attention' for i in range(num_layers)]
  if not types and family == 'smollm3' and window:      # SmolLM3 slides its NoPE layers
    types = ['sliding_attention' if i in nope_layers else 'full_attention' for i in range(num_layers)]
  if family == 'llama4_text':      # chunked attention on the RoPE layers (Llama4TextConfig's default)
    chunked = hf.get('attention_chunk_size', 8192)
    types = types or ['chunked_attention' if i not in nope_layers and chunked else 'full_attention'
                      for i in range(num_layers)]
    return 0, tuple(types) if 'chunked_attention' in types else ()
  if family in ('llama', 'mistral', 'phi3', 'olmo2') and types and len(set(types)) > 1:
    raise ValueError(f'layer_types={types}: per-layer attention types are not part of HF {family}')
  types = tuple(types or ())
  unknown = sorted(set(types) - {'full_attention', 'sliding_attention'})
  if unknown:
    raise ValueError(f'layer_types has {unknown}: only full_attention and sliding_attention are supported '
                     '(chunked_attention in llama4_text)')
  if len(types) not in (0, num_layers):
    raise ValueError(f'layer_types has {len(types)} entries for {num_layers} layers')
  if family in WINDOW_EVERYWHERE:
    return int(window), ()
  if 'sliding_attention' not in types:
    window, types = 0, ()
  return int(window), types


def _nope_layers(hf, family, num_layers):
  """The layers without RoPE: SmolLM3's and Llama 4's no_rope_layers (1 = RoPE, 0 = none) or
  their interval."""
  if family not in ('smollm3', 'llama4_text'):
    return ()
  flags = hf.get('no_rope_layers')
  if flags is None:
    interval = hf.get('no_rope_layer_interval', 4)
    flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
  if len(flags) != num_layers or set(flags) - {0, 1}:
    raise ValueError(f'no_rope_layers={flags}: needs one 0 (no RoPE) or 1 (RoPE) per layer ({num_layers})')
  return tuple(i for i, f in enumerate(flags) if not f)


def _refuse(hf, unsupported):
  """Keys whose set values change the model in ways flatron does not implement."""
  for key, allowed in unsupported.items():
    if hf.get(key) not in allowed:
      raise ValueError(f'{key}={hf[key]!r} is not supported (flatron implements {allowed[-1]!r})')


def config_from_hf(hf_config: dict, base_model):
  """A copy of the `model` config section `base_model` with what an HF config dict (one of
  FAMILIES) sets.

  Keys HF has no counterpart for (optim, dropouts other than attention, fusions...) keep
  `base_model`'s values.
  """
  hf = hf_config
  family = hf.get('model_type')
  if family not in FAMILIES:
    if 'LlamaForCausalLM' not in (hf.get('architectures') or []):
      hint = {'gemma3': ' (a Gemma 3 vision-language config: import its text model, Gemma3ForCausalLM)',
              'llama4': ' (a Llama 4 vision-language config: import its text model, Llama4ForCausalLM with its '
                        'text_config)'}.get(family, '')
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
  dropouts = {k: float(hf.get(k) or 0.0) for k in ('resid_pdrop', 'embd_pdrop')}    # Phi-3's
  if len(set(dropouts.values())) > 1:
    raise ValueError(f'resid_pdrop={dropouts["resid_pdrop"]} differs from embd_pdrop={dropouts["embd_pdrop"]}; '
                     'flatron has one model.hidden_dropout for both')
  attention_bias, mlp_bias = bool(hf.get('attention_bias', False)), bool(hf.get('mlp_bias', False))
  if family == 'gpt_oss':          # its router and experts always have biases
    attention_bias = mlp_bias = bool(hf.get('attention_bias', True))
    if not attention_bias:
      raise ValueError('attention_bias=False: gpt-oss\'s router and experts keep their biases, and flatron has '
                       'one model.has_bias for every linear')
  if family == 'llama4_text' and attention_bias:
    raise ValueError('attention_bias=True: Llama 4\'s experts have no biases, and flatron has one model.has_bias '
                     'for every linear')
  if attention_bias != mlp_bias:
    # Our single has_bias switch covers attention and MLP linears together.
    raise ValueError(f'attention_bias={attention_bias} differs from mlp_bias={mlp_bias}; '
                     'flatron supports biases in all linears or none')
  m = copy.deepcopy(base_model)
  m.architecture = FAMILIES[family][1]
  m.hidden_size = hf['hidden_size']
  m.ffn_hidden_size = hf['intermediate_size_mlp' if family == 'llama4_text' else 'intermediate_size']
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
  m.nope_layers = _nope_layers(hf, family, m.num_layers)
  m.sliding_window, m.layer_types = _layer_types(hf, family, m.num_layers, m.nope_layers)
  m.normalization = 'rmsnorm'
  m.layernorm_epsilon = float(hf.get('rms_norm_eps', 1e-6))
  m.activation = ACTIVATIONS[act]
  m.has_bias = attention_bias
  m.qkv_bias = family == 'qwen2' or (family == 'qwen2_moe' and bool(hf.get('qkv_bias', True)))  # q, k, v only
  _moe_from_hf(hf, family, m)
  for key in GEMMA_KEYS + OLMO2_KEYS:
    m[key] = (gemma and key in GEMMA_KEYS) or (family == 'olmo2' and key in OLMO2_KEYS)
  m.qk_norm = m.qk_norm or family in ('qwen3', 'qwen3_moe')
  m.rmsnorm_scale_in_fp32 = m.rmsnorm_scale_in_fp32 or family == 'gpt_oss'   # as its RMSNorm: weight x fp32, then cast
  m.attention_sinks = family == 'gpt_oss'
  llama4 = family == 'llama4_text'       # chunked RoPE layers, NoPE layers with a temperature, L2 q/k norms
  m.attention_chunk_size = int(hf.get('attention_chunk_size', 8192) or 0) if llama4 else 0
  m.attn_temperature_tuning = llama4 and bool(hf.get('attn_temperature_tuning', True))
  m.attn_floor_scale, m.attn_scale = (int(hf.get('floor_scale', 8192)), float(hf.get('attn_scale', 0.1))) if llama4 \
      else (8192, 0.1)
  m.rope_interleave = llama4
  m.qk_l2_norm = llama4 and bool(hf.get('use_qk_norm', True))
  m.qk_norm_span = 'projection' if family == 'olmo2' else 'head'
  if dropouts['resid_pdrop']:
    m.hidden_dropout = dropouts['resid_pdrop']
  m.query_pre_attn_scalar = int(hf.get('query_pre_attn_scalar', 256)) if gemma else 0
  m.mla.kv_lora_rank = 0
  if family == 'deepseek_v3':      # latent attention; model.head_dim is then the query / key heads' width
    # the original DeepSeek code's router keys; transformers' DeepSeek-V3 (and flatron) is sigmoid + noaux_tc
    _refuse(hf, {'scoring_func': (None, 'sigmoid'), 'topk_method': (None, 'noaux_tc'), 'moe_layer_freq': (None, 1)})
    for key in MLA_KEYS:
      m.mla[key] = int(hf[key] or 0)
    m.mla.rope_interleave = bool(hf.get('rope_interleave', True))
    m.head_dim = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
  m.share_embeddings_and_output_weights = bool(hf.get('tie_word_embeddings', gemma))
  m.attention_dropout = float(hf.get('attention_dropout', 0.0))
  m.init_method_std = float(hf.get('initializer_range', m.init_method_std))
  return m


def _moe_from_hf(hf, family, m):
  """model.moe from Mixtral's / Qwen2-MoE's / Qwen3-MoE's keys (HF routes every token: dropless)."""
  moe = m.moe
  moe.num_experts = 0
  if family not in MOE_FAMILIES:
    return
  if hf.get('router_jitter_noise'):
    raise ValueError(f'router_jitter_noise={hf["router_jitter_noise"]} is not supported (flatron implements 0)')
  mixtral, gpt_oss, deepseek = family == 'mixtral', family == 'gpt_oss', family == 'deepseek_v3'
  llama4 = family == 'llama4_text'
  moe.num_experts = hf.get('num_experts') or hf.get('n_routed_experts') or hf['num_local_experts']
  moe.dense_layers = tuple(int(i) for i in hf.get('mlp_only_layers') or ())
  if deepseek:                     # the first k layers dense
    moe.dense_layers = tuple(range(int(hf.get('first_k_dense_replace', 3) or 0)))
  if llama4:                       # its moe_layers, or every interleave_moe_layer_step-th
    step = int(hf.get('interleave_moe_layer_step', 1))
    moe_layers = hf.get('moe_layers') or list(range(step - 1, m.num_layers, step))
    moe.dense_layers = tuple(i for i in range(m.num_layers) if i not in set(moe_layers))
  moe.top_k = hf.get('num_experts_per_tok', {'mixtral': 2, 'qwen2_moe': 4, 'qwen3_moe': 8, 'gpt_oss': 4,
                                              'deepseek_v3': 8, 'llama4_text': 1}[family])
  if gpt_oss and hf.get('experts_per_token', moe.top_k) != moe.top_k:      # OpenAI's name beside transformers'
    raise ValueError(f"experts_per_token={hf['experts_per_token']} (OpenAI's key) but the experts a token runs are "
                     f'num_experts_per_tok={moe.top_k} (what transformers reads); make them agree')
  moe.frequency = 1 if mixtral or gpt_oss or llama4 else hf.get('decoder_sparse_step', 1)
  # gpt-oss: softmax over the top-k logits, which is the softmax's top k renormalized
  moe.normalize_top_k_affinities = True if mixtral or gpt_oss else bool(hf.get('norm_topk_prob', False))
  moe.dropless, moe.routing_algorithm = True, 'top_k'
  moe.router_activation = 'sigmoid' if deepseek or llama4 else 'softmax'
  moe.scale_expert_input = llama4          # Llama 4: the sigmoid score scales the expert's input
  # DeepSeek-V3: groups of experts, the correction bias, the routed experts' scale, one plain shared
  # expert (an absent key: transformers' class default)
  moe.num_groups, moe.top_k_groups = (int(hf.get('n_group', 8) or 1), int(hf.get('topk_group', 4) or 1)) if deepseek \
      else (1, 1)
  moe.routed_scaling_factor = float(hf.get('routed_scaling_factor', 2.5)) if deepseek else 1.0
  moe.load_balance_bias = deepseek
  moe.shared_expert_gate = not (deepseek or llama4)
  moe.output_router_logits = bool(hf.get('output_router_logits', False))
  moe.router_aux_loss_coef = float(hf.get('router_aux_loss_coef', 0.001))
  moe.ffn_hidden_size = 0 if mixtral or gpt_oss else hf['intermediate_size' if llama4 else 'moe_intermediate_size']
  moe.expert_activation = 'clamped_swiglu' if gpt_oss else 'swiglu'
  if gpt_oss:
    moe.swiglu_alpha, moe.swiglu_limit = float(hf.get('swiglu_alpha', 1.702)), float(hf.get('swiglu_limit', 7.0))
  moe.shared_expert_intermediate_size = hf['shared_expert_intermediate_size'] if family == 'qwen2_moe' else 0
  if deepseek:
    moe.shared_expert_intermediate_size = int(hf.get('n_shared_experts', 1) or 0) * moe.ffn_hidden_size
  if llama4:                       # one shared expert as wide as the routed ones
    moe.shared_expert_intermediate_size = moe.ffn_hidden_size
