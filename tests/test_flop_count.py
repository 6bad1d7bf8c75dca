"""model/flop_count.py: training FLOPs per token pinned to hand counts from published shapes
(Gemma 3 270M: heads x head_dim 1024 against hidden 640, sliding-window layers; Qwen3-0.6B:
heads x head_dim 2048 against hidden 1024), LoRA's frozen base, MoE's active experts."""
from configs import base as base_config
from model import flop_count, hf_config, param_table

# google/gemma-3-270m's config.json (text model), the keys the import reads
GEMMA3_270M = {
    'architectures': ['Gemma3ForCausalLM'], 'model_type': 'gemma3_text', 'hidden_size': 640,
    'num_hidden_layers': 18, 'num_attention_heads': 4, 'num_key_value_heads': 1, 'head_dim': 256,
    'intermediate_size': 2048, 'vocab_size': 262144, 'max_position_embeddings': 32768,
    'hidden_activation': 'gelu_pytorch_tanh', 'query_pre_attn_scalar': 256, 'rms_norm_eps': 1e-6,
    'rope_theta': 1000000.0, 'rope_local_base_freq': 10000.0, 'rope_scaling': None, 'sliding_window': 512,
    'layer_types': ['full_attention' if (i + 1) % 6 == 0 else 'sliding_attention' for i in range(18)],
    'attention_bias': False, 'attn_logit_softcapping': None, 'final_logit_softcapping': None,
    'tie_word_embeddings': True, 'initializer_range': 0.02,
}


def gemma3_270m():
  return hf_config.config_from_hf(GEMMA3_270M, base_config.get_config().model)


def qwen3_06b():
  """Qwen/Qwen3-0.6B's shape as a model section: no sliding window (use_sliding_window false),
  per-head RMSNorm on q and k, plain (not 1 + w) norm weights, tied embeddings."""
  m = base_config.get_config().model
  m.hidden_size, m.num_layers, m.ffn_hidden_size, m.vocab_size = 1024, 28, 3072, 151936
  m.num_attention_heads, m.num_kv_heads, m.head_dim = 16, 8, 128
  m.normalization, m.activation, m.has_bias, m.position_embedding_type = 'rmsnorm', 'swiglu', False, 'rope'
  m.qk_norm, m.rmsnorm_unit_offset, m.sandwich_norm = True, False, False
  m.share_embeddings_and_output_weights, m.sliding_window, m.layer_types = True, 0, ()
  return m


def test_gemma3_270m_counts_its_heads_and_windows():
  m = gemma3_270m()
  attention = 640 * 4 * 256 + 2 * 640 * 1 * 256 + 4 * 256 * 640      # q, k, v, o
  layer = attention + 2 * 256 + 4 * 640 + 3 * 640 * 2048               # q/k norms, sandwich norms, GeGLU
  n = 18 * layer + 640 + 262144 * 640                                  # final norm; the tied table is the head
  assert n == 268_098_176 == param_table.count_params(m)
  assert flop_count.attention_spans(m, 1024) == [512] * 5 + [1024] + [512] * 5 + [1024] + [512] * 5 + [1024]
  # 15 sliding layers attend 512 keys, 3 full ones the whole sequence
  assert flop_count.flops_per_token(m, 1024) == 6 * n + 12 * 4 * 256 * (15 * 512 + 3 * 1024) == 1_740_709_632
  assert flop_count.flops_per_token(m, 32768) == 6 * n + 12 * 4 * 256 * (15 * 512 + 3 * 32768) == 2_910_920_448
  # a sequence inside the window: every layer attends all of it
  assert flop_count.flops_per_token(m, 256) == 6 * n + 12 * 4 * 256 * 18 * 256


def test_qwen3_06b_counts_heads_times_head_dim_not_hidden():
  m = qwen3_06b()
  attention = 1024 * 16 * 128 + 2 * 1024 * 8 * 128 + 16 * 128 * 1024
  layer = attention + 2 * 128 + 2 * 1024 + 3 * 1024 * 3072            # q/k norms, 2 norms, SwiGLU
  n = 28 * layer + 1024 + 151936 * 1024
  assert n == 596_049_920 == param_table.count_params(m)
  assert flop_count.flops_per_token(m, 4096) == 6 * n + 12 * 28 * 16 * 128 * 4096 == 6_394_871_808


def test_a_window_on_every_layer_without_layer_types_slides_them_all():
  m = qwen3_06b()
  m.sliding_window = 1024                # Mistral's form: a window and no per-layer types
  n = param_table.count_params(m, embedding=False)
  assert flop_count.flops_per_token(m, 4096) == 6 * n + 12 * 28 * 16 * 128 * 1024


def tiny(**overrides):
  m = base_config.get_config().model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 32, 48
  m.num_attention_heads, m.num_kv_heads, m.vocab_size = 4, 2, 100
  m.max_position_embeddings = 32
  m.update(overrides)
  return m


def test_flops_per_token_formula():
  m = tiny()
  n_nonembed = param_table.count_params(m) - 100 * 32
  assert flop_count.flops_per_token(m, 16) == 6 * n_nonembed + 12 * 2 * 4 * 8 * 16


def test_lora_charges_4_flops_per_frozen_parameter():
  m = tiny()
  m.peft.lora_rank = 4
  n, trained = param_table.count_params(m, embedding=False), param_table.count_params(m, embedding=False, trainable_only=True)
  assert 0 < trained < n
  assert flop_count.flops_per_token(m, 16) == 6 * trained + 4 * (n - trained) + 12 * 2 * 4 * 8 * 16


def test_flops_count_active_experts():
  cfg = base_config.get_config().model
  dense = flop_count.flops_per_token(cfg, 128)
  cfg.moe.update(num_experts=8, top_k=2)
  # 2 of 8 experts run: the active parameters are those of a dense model with 2 MLPs + routers
  extra = 2 * (cfg.hidden_size * 3 * cfg.ffn_hidden_size) + 2 * 8 * cfg.hidden_size
  assert flop_count.flops_per_token(cfg, 128) == dense + 6 * extra
