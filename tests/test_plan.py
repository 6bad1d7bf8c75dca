"""tools/plan.py: the search keeps only layouts configs/validate.py accepts and the memory
estimate fits, counts the rest by reason; the published-figure table (tools/plan_published.py)
is pinned; the command line's errors."""
import os
import sys

import pytest

from configs import llama_tiny, validate
from estimates import clusters, memory
from tests import procs
from tools import plan, plan_published, plan_space


def test_search_keeps_only_valid_fitting_layouts():
  config = llama_tiny.get_config()
  config.data.global_batch_size = 8
  cluster = clusters.LOCAL_DEFAULT
  result = plan.search(config, cluster, 4, keep=1000)
  assert result.ranked and result.fitting == len(result.ranked)
  assert result.fitting + sum(result.refused.values()) == result.searched
  for c in result.ranked:
    assert validate.check(c.config, 4) == []
    assert c.config.distributed_strategy.tensor_model_parallel_size * c.config.distributed_strategy.pipeline_model_parallel_size * c.layout.dp == 4
    stages = plan.stage_sizes(c.config, 4)           # the first and last stage's own parameters
    assert max(memory.estimate(c.config, sizes, c.layout.dp, p)['total'] for p, sizes in stages) == c.memory_bytes
    assert c.memory_bytes <= cluster.memory_bytes
  steps = [c.prediction.step_s for c in result.ranked]
  assert steps == sorted(steps)
  # llama_tiny has 4 layers: pp4 x v2 is refused by the pipeline check, and counted
  assert any('virtual' in reason for reason in result.refused)
  # the search's cut (no simulation for a layout slower than the keep-th best) changes no pick
  top = plan.search(config, cluster, 4, keep=3)
  assert [c.layout for c in top.ranked] == [c.layout for c in result.ranked[:3]] and top.fitting == result.fitting


def test_memory_refusals_are_counted():
  config = llama_tiny.get_config()
  tiny = plan.dataclasses.replace(clusters.LOCAL_DEFAULT, memory_bytes=1)
  result = plan.search(config, tiny, 2)
  assert not result.ranked and result.refused["memory: the estimate exceeds the device's memory"] > 0
  assert 'no layout fits' in plan.report(config, tiny, 2, result)


def test_long_sequences_search_context_parallelism():
  config = llama_tiny.get_config()
  config.data.seq_length, config.data.global_batch_size = 8192, 8
  result = plan.search(config, clusters.CLUSTERS['h100'], 4, keep=1000)
  cps = {c.layout.cp for c in result.ranked}
  assert cps == {1, 2, 4}                       # 8: a slice of 1,024 tokens is the floor, and 8 > 4 devices
  for c in result.ranked:
    d = c.config.distributed_strategy
    assert d.context_parallel_size == c.layout.cp and c.layout.dp * c.layout.cp * c.layout.tp * c.layout.pp == 4
    assert validate.check(c.config, 4) == [] and (c.layout.cp == 1 or c.config.model.fusions.ring_attention)
    assert (c.prediction.terms['cp_comm'] > 0) == (c.layout.cp > 1)
  assert 'cp2' in next(c for c in result.ranked if c.layout.cp == 2).layout.describe()
  # short sequences: cp is not searched
  assert plan_space.context_degrees(llama_tiny.get_config(), 4) == [1]


def test_moe_configs_search_expert_parallelism():
  from configs import mixtral_tiny  # pylint: disable=import-outside-toplevel
  config = mixtral_tiny.get_config()
  result = plan.search(config, clusters.CLUSTERS['h100'], 4, keep=1000)
  eps = {c.layout.ep for c in result.ranked}
  assert eps == {1, 2, 4}
  for c in result.ranked:
    assert c.config.distributed_strategy.expert_model_parallel_size == c.layout.ep and c.layout.dp % c.layout.ep == 0
    assert (c.prediction.terms['ep_comm'] > 0) == (c.layout.ep > 1)
    # the memory estimate of the stages' own parameters: 1/ep of the experts per rank
    stages = plan.stage_sizes(c.config, 4)
    assert max(memory.estimate(c.config, sizes, c.layout.dp, p)['total'] for p, sizes in stages) == c.memory_bytes
  assert plan_space.expert_degrees(llama_tiny.get_config(), 4) == [1]
  # MoE with context parallelism: dropless, or dropping past capacity over whole rows; with cp
  # and ep the experts' gradients are summed across the cp ranks too
  config.data.seq_length = 4096
  config.data.global_batch_size = 4
  result = plan.search(config, clusters.CLUSTERS['h100'], 4, keep=1000)
  assert {(c.layout.cp, c.layout.ep) for c in result.ranked} >= {(2, 1), (2, 2), (1, 4)}
  assert not any('context_parallel_size' in reason for reason in result.refused)


# The documented table (docs/planning.md): the model's arithmetic, pinned. A change to the
# model or to a cluster entry moves these on purpose: update the docs' table with them.
PINNED = {
    'Llama-3.1-8B, NxD, 32 x trn1.32xlarge': 46.22,
    'Llama-3.1-70B, NxD, 32 x trn1.32xlarge': 7.113,
    'Llama-3.1-8B, torchtitan FSDP, 8 x H100': 6299,
    'Llama-3.1-8B, torchtitan FSDP + Float8, 8 x H100': 8533,
    'GPT 18.4B, Megatron-LM, 256 x A100 (t8 p1)': 134.7,
    'GPT 145.6B, Megatron-LM, 1536 x A100 (t8 p8)': 161.2,
}


def test_published_figures_table():
  rows = plan_published.table(with_pick=False)
  assert {row.name for row, *_ in rows} == set(PINNED)
  for row, _, value, _ in rows:
    assert value == pytest.approx(PINNED[row.name], rel=2e-3), row.name
    assert abs(value / row.published - 1) < 0.2, row.name      # the bound, as documented


def test_an_nxd_yaml_needs_its_config_json():
  from configs import nxd_yaml  # pylint: disable=import-outside-toplevel
  fixtures = os.path.join(procs.ROOT, 'tests', 'fixtures', 'nxd_yaml')
  config = nxd_yaml.get_config(os.path.join(fixtures, '2.26', 'hf_llama3.1_8B_config.yaml'))
  with pytest.raises(validate.ConfigError, match='--config.model.model_config=PATH'):
    plan.resolve(config)
  config.model.model_config = os.path.join(fixtures, 'llama3_8b_config.json')
  plan.resolve(config)
  assert (config.model.num_layers, config.model.num_kv_heads, config.distributed_strategy.tensor_model_parallel_size) == (32, 8, 32)


@pytest.mark.parametrize('recipe,model,axis', [('hf_mixtral_8x7b_config.yaml', 'mixtral_8x7b_config.json', 'ep'),
                                                ('hf_llama3_70B_CP_config.yaml', 'llama3_70b_config.json', 'cp')])
def test_the_documented_cp_and_ep_examples_resolve_and_predict(recipe, model, axis):
  from configs import nxd_yaml  # pylint: disable=import-outside-toplevel
  from estimates import step_time  # pylint: disable=import-outside-toplevel
  fixtures = os.path.join(procs.ROOT, 'tests', 'fixtures', 'nxd_yaml')
  config = nxd_yaml.get_config(os.path.join(fixtures, '2.26', recipe))
  config.model.model_config = os.path.join(fixtures, model)
  plan.resolve(config)
  d = config.distributed_strategy
  if axis == 'ep':       # NxD's recipe runs ep 1: the planner's example layout, dp64 ep8 on 64 H100
    assert (config.model.moe.num_experts, config.model.moe.top_k) == (8, 2)
    plan_space.Layout(dp=64, tp=1, pp=1, zero1=True, recompute='selective', ep=8).apply(config)
  else:                  # NxD's own layout: tp32 x cp2 x pp8 on 16 trn1 nodes (512 ranks)
    assert (d.context_parallel_size, d.tensor_model_parallel_size, d.pipeline_model_parallel_size) == (2, 32, 8)
  world = 64 if axis == 'ep' else 512
  p = step_time.predict(config, clusters.CLUSTERS['h100' if axis == 'ep' else 'trn1.32xlarge'], world)
  assert p.terms[f'{axis}_comm'] > 0 and p.tokens_per_s > 0


def _plan(*args):
  return procs.run([sys.executable, '-m', 'tools.plan', *args], timeout=300)


def test_cli_refuses_an_unknown_cluster():
  out = _plan('--config=configs/llama_tiny.py', '--cluster=h900', '--nodes=1')
  assert out.returncode == 2 and 'no such cluster' in out.stderr and 'trn1.32xlarge' in out.stderr


def test_cli_refuses_when_nothing_fits():
  out = _plan('--config=configs/llama3_70b.py', '--cluster=h100', '--devices=1')
  assert out.returncode == 2 and 'no layout of 1 h100 devices fits' in out.stderr
  assert 'memory: the estimate exceeds' in out.stdout


def test_cli_prints_the_ranked_layouts():
  out = _plan('--config=configs/llama_tiny.py', '--cluster=h100', '--devices=2', '--top=3')
  assert out.returncode == 0, out.stderr
  assert '| layout | tokens/s | MFU |' in out.stdout and 'dp' in out.stdout


def test_plan_cluster_key_is_validated():
  config = llama_tiny.get_config()
  config.trainer.plan_cluster = 'h900'
  assert any(p.startswith("trainer.plan_cluster='h900' is unknown; valid: auto, none, a100, h100")
             for p in validate.check(config))
  config.trainer.plan_cluster = 'trn1.32xlarge'
  assert validate.check(config) == []
