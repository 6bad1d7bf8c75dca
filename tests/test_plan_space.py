"""tools/plan_space.py: a layout sets its keys, and the ZeRO stages searched where data
parallelism has ranks to shard over (HSDP within a node)."""
from configs import llama_tiny
from tools import plan_space


def test_layout_apply_sets_the_keys():
  c = plan_space.Layout(dp=2, tp=2, pp=2, vpp=2, zero1=True, sp=True, micro_batch=4, recompute='full', cp=2, ep=2).apply(
      llama_tiny.get_config())
  d = c.distributed_strategy
  assert (d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.virtual_pipeline_model_parallel_size,
          d.zero1, d.sequence_parallel, c.data.micro_batch_size) == (2, 2, 2, True, True, 4)
  assert (d.context_parallel_size, d.expert_model_parallel_size, c.model.fusions.ring_attention) == (2, 2, True)
  assert c.model.activations_checkpoint_granularity == 'full'
  assert (d.zero_stage, d.data_parallel_shard_size) == (1, 0)
  d = plan_space.Layout(dp=4, tp=2, pp=1, zero1=True, zero_stage=3, shard=2).apply(llama_tiny.get_config()).distributed_strategy
  assert (d.zero1, d.zero_stage, d.data_parallel_shard_size) == (True, 3, 2)


def test_zero_stages_are_searched_where_dp_has_ranks_and_hsdp_within_a_node():
  assert plan_space.zero_choices(1, 8) == [(False, 1, 0)]
  assert plan_space.zero_choices(8, 1) == [(False, 1, 0), (True, 1, 0), (True, 2, 0), (True, 3, 0)]   # one node
  assert plan_space.zero_choices(32, 2)[-1] == (True, 3, 4)         # 4 dp ranks x tp 2 fill a node of 8
  assert plan_space.Layout(dp=32, tp=2, pp=1, zero1=True, zero_stage=3, shard=4).describe().startswith(
      'dp32 tp2 pp1 zero3 hsdp4')
