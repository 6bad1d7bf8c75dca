"""estimates/activations.py: the activation formula in closed form (its measurement is pinned
in tests/test_remat.py)."""
import pytest

from configs import llama7b
from estimates import activations


def test_full_recompute_keeps_only_layer_inputs():
  c = llama7b.get_config()
  s, b, h = c.data.seq_length, c.data.micro_batch_size, c.model.hidden_size
  c.model.activations_checkpoint_granularity = 'full'
  assert activations.activation_bytes_per_layer(c, 2) == 2 * s * b * h
  c.model.activations_checkpoint_granularity = None
  assert activations.activation_bytes_per_layer(c, 2) > 10 * 2 * s * b * h


def test_llama_activation_formula_in_closed_form():
  c = llama7b.get_config()                     # fp32, SDPA, RoPE, no dropout
  s, b, h, f = c.data.seq_length, c.data.micro_batch_size, c.model.hidden_size, c.model.ffn_hidden_size
  a, n = c.model.num_attention_heads, s * b
  assert activations.activation_bytes_per_layer(c) == 4 * (11 * n * h + 4 * n * f) + 8 * n + 4 * b * a * s
  c.model.num_kv_heads = 8                     # GQA drops k and v of the missing heads
  d = h // a
  assert activations.activation_bytes_per_layer(c) == (4 * (11 * n * h + 4 * n * f) + 8 * n + 4 * b * a * s
                                                  - 8 * n * (a - 8) * d)


def gpt_options(b=2):
  c = llama7b.get_config()
  m = c.model
  m.normalization, m.activation, m.position_embedding_type = 'layernorm', 'gelu', 'learned_absolute'
  m.ffn_hidden_size = 4 * m.hidden_size
  m.hidden_dropout = m.attention_dropout = 0.1
  c.data.seq_length, c.data.micro_batch_size = 2048, b
  return c


def test_gpt_block_in_16_bit_is_korthikanti_plus_fp32_softmax_and_mask():
  c = gpt_options()
  s, b, h, a = 2048, 2, c.model.hidden_size, c.model.num_attention_heads
  korthikanti = 34 * s * b * h + 5 * a * s * s * b
  ours = korthikanti + 2 * a * s * s * b + s * s + 8 * s * b
  assert activations.activation_bytes_per_layer(c, 2) == ours
  # TP keeps the norms, linear inputs and residual masks whole: sbh (10 + 24/t) + ...
  t = 4
  assert activations.activation_bytes_per_layer(c, 2, tp=t) == (
      10 * s * b * h + 24 * s * b * h // t + 7 * a * s * s * b // t + s * s + 8 * s * b)
  # SP divides it all, the linear inputs too (kept as the shard, gathered again in backward):
  # Korthikanti's (34/t) sbh
  c.distributed_strategy.sequence_parallel = True
  assert activations.activation_bytes_per_layer(c, 2, tp=t) == (
      34 * s * b * h // t + 7 * a * s * s * b // t + s * s + 8 * s * b // t)
  c.precision.type = 'autocast'                # autocast's linears keep what they cast: the gathered input
  assert activations.activation_bytes_per_layer(c, 2, tp=t) == (
      4 * s * b * h + 30 * s * b * h // t + 7 * a * s * s * b // t + s * s + 8 * s * b // t)


def test_selective_recompute_leaves_no_quadratic_term():
  c = gpt_options()
  c.model.activations_checkpoint_granularity = 'selective'
  short = activations.activation_bytes_per_layer(c, 2)
  c.data.seq_length *= 2
  assert activations.activation_bytes_per_layer(c, 2) == 2 * short


@pytest.mark.parametrize('family,flash', [('deepseek_v3', False), ('deepseek_v3', True), ('gpt_oss', True),
                                          ('llama4', False)])
def test_the_2026_moe_blocks_are_counted_as_they_are_measured(family, flash):
  """Each family's block (MoE) against what autograd keeps, within 3%: DeepSeek-V3's latent
  attention (q bottleneck, latent norms, narrower values; SDPA on the CPU falls back to its math
  path), gpt-oss's sinks (always the explicit softmax), biases and clamped SwiGLU, Llama 4's
  input-scaled experts."""
  from tests import parity  # pylint: disable=import-outside-toplevel
  c = parity.parity_config(family=family, layers=2)
  c.model.moe.dense_layers = ()
  c.model.fusions.flash_attention = flash
  c.data.seq_length, c.data.micro_batch_size = 64, 2
  estimated, measured = activations.activation_bytes_per_layer(c), activations.measured_bytes_per_layer(c)
  assert abs(estimated / measured - 1) < 0.03, (estimated, measured)
