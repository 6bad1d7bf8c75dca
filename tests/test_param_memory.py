"""estimates/param_memory.py: what a rank holds of the parameters at each ZeRO stage and under HSDP."""
import math

from configs import llama3_8b
from estimates import memory, param_memory
from model import param_table
from tests import parity

SIZES = {'embed_tokens.weight': 400, 'norm.weight': 10, 'lm_head.weight': 400,
         **{f'layers.{i}.{p}': n for i in range(4) for p, n in (('mlp.up_proj.weight', 100), ('input_layernorm.weight', 10))}}


def test_zero3_holds_its_rows_and_gathers_the_head_and_three_layers():
  c = parity.parity_config(zero1=True, zero_stage=3, layers=4)      # fp32: 4 bytes
  held, per_layer, head, kept = param_memory.param_bytes(c, SIZES, dp=2)
  assert held == 4 * sum(math.ceil(v / 2) for v in SIZES.values())
  assert (per_layer, head, kept) == (4 * 110, 4 * 410, 3)
  assert param_memory.gathered_bytes(c, SIZES, 2) == 4 * 410 + 3 * 4 * 110
  for key in ('reshard_after_forward', 'reshard_after_backward'):
    c.distributed_strategy[key] = False
    assert param_memory.gathered_bytes(c, SIZES, 2) == 4 * 410 + 4 * 4 * 110   # every layer kept
    c.distributed_strategy[key] = True
  c.model.share_embeddings_and_output_weights = True
  assert param_memory.param_bytes(c, SIZES, dp=2)[2] == 4 * 810     # a tied head is the embedding too


def test_without_zero3_every_box_is_whole_and_nothing_is_gathered():
  for stage in (1, 2):
    c = parity.parity_config(zero1=True, zero_stage=stage)
    assert param_memory.param_bytes(c, SIZES, dp=2) == (4 * sum(SIZES.values()), 0, 0, 0)
  assert param_memory.param_bytes(parity.parity_config(zero1=True, zero_stage=3), SIZES, dp=1)[1:] == (0, 0, 0)


def test_hsdp_shards_over_its_group_and_experts_over_their_dp():
  c = parity.parity_config(zero1=True, zero_stage=3, shard=2)
  assert param_memory.zero_parts(c, 4) == 2 and param_memory.parts_of(c, 'layers.0.mlp.up_proj.weight', 4) == 2
  c = parity.parity_config(zero1=True, zero_stage=3, moe=4, ep=2)
  assert param_memory.parts_of(c, 'layers.0.mlp.experts.gate_proj', 8) == 4     # dp / ep
  assert param_memory.zero_parts(parity.parity_config(), 8) == 1


def test_llama3_8b_on_8_devices_holds_an_eighth_of_its_weights_under_zero3():
  c = llama3_8b.get_config()
  c.precision.type, c.device = 'mixed_precision', 'cuda'
  c.distributed_strategy.zero1 = True
  n = param_table.count_params(c.model)
  zero1 = memory.estimate(c, dp=8)
  c.distributed_strategy.zero_stage = 3
  zero3 = memory.estimate(c, dp=8)
  assert zero1['params'] == 2 * n and abs(zero3['params'] - 2 * n / 8) < 2 * 8 * 2**20    # row padding
  layer = 2 * (n - 2 * c.model.vocab_size * c.model.hidden_size) / c.model.num_layers
  assert 0 < zero3['gathered'] <= 2 * c.model.vocab_size * c.model.hidden_size + 3 * layer + 2 * 4096
  assert zero1['master'] == zero3['master'] and zero3['grads'] < zero1['grads']
  assert zero3['total'] < zero1['total'] - 2 * n * 6 / 8      # most of the 14 GB of weights and gradients gone
