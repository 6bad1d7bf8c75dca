"""One micro batch's costs (estimates/micro_batch_cost.py): a layer's forward and backward, the
TP collectives outside the layers, the head; how TP, SP, recompute and the device move them.
How they add up to a step is tests/test_step_time.py's."""
import dataclasses

import pytest

from configs import llama3_8b
from estimates import clusters, micro_batch_cost

H100 = clusters.CLUSTERS['h100']


def _config(**strategy):
  c = llama3_8b.get_config()
  c.precision.type, c.device = 'mixed_precision', 'cuda'
  for k, v in strategy.items():
    c.distributed_strategy[k] = v
  return c


def test_a_layer_without_recompute_runs_its_backward_at_twice_its_forward():
  c = _config()
  c.model.activations_checkpoint_granularity = None
  fwd, bwd, comm = micro_batch_cost.layer_cost(c, H100, 1)
  assert bwd == pytest.approx(2 * fwd) and comm['tp'] == (0.0, 0.0)
  c.model.activations_checkpoint_granularity = 'full'         # the forward again in the backward
  assert micro_batch_cost.layer_cost(c, H100, 1)[1] == pytest.approx(3 * fwd)


def test_sequence_parallelism_shrinks_the_elementwise_work_of_norms_and_residuals():
  attn, mlp = micro_batch_cost.elementwise_bytes(_config(), 4)
  attn_sp, mlp_sp = micro_batch_cost.elementwise_bytes(_config(sequence_parallel=True), 4)
  assert attn_sp < attn and mlp_sp < mlp


def test_collectives_outside_the_layers_need_tp_and_the_first_stage_pays_the_embeddings():
  c = _config()
  assert micro_batch_cost.edge_comm(c, H100, 1) == (0.0, 0.0)
  first, later = micro_batch_cost.edge_comm(c, H100, 8), micro_batch_cost.edge_comm(c, H100, 8, first_stage=False)
  assert first[0] > later[0] > 0 and first[1] == later[1] > 0     # no SP: the embedding's sum is forward only


def test_xla_hides_backward_tp_collectives_behind_the_weight_gradients():
  c = _config(sequence_parallel=True)
  c.model.activations_checkpoint_granularity = None
  eager = micro_batch_cost.layer_cost(c, H100, 8)[2]['tp']
  xla = micro_batch_cost.layer_cost(c, dataclasses.replace(H100, device='xla'), 8)[2]['tp']
  assert xla[0] == eager[0] and xla[1] < eager[1]


def test_the_head_backward_pays_its_gemm_twice_and_chunking_recomputes_it():
  c = _config()
  fwd, bwd = micro_batch_cost.head_cost(c, H100, 1)
  c.model.fusions.chunked_cross_entropy = 4096
  assert micro_batch_cost.head_cost(c, H100, 1)[1] > bwd > fwd
