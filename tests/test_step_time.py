"""The step-time model's arithmetic: alpha-beta collectives, which links a group uses, the
pipeline term against the simulator, and how the layout keys move the terms."""
import dataclasses
import json

import pytest

from configs import llama3_8b, llama_tiny
from estimates import clusters, collective_cost, micro_batch_cost, schedule_sim, step_time
from model import flop_count, param_table, transformer

H100 = clusters.CLUSTERS['h100']


@pytest.mark.parametrize('p,m,v', [(2, 5, 1), (2, 33, 1), (4, 64, 1), (4, 64, 2), (4, 64, 4), (8, 48, 2), (8, 40, 1)])
def test_pipeline_is_the_simulator(p, m, v):
  for bwd, comm in ((1.0, 0.005), (1.5, 0.05)):     # ratios the cache keeps exactly (2 digits, 0.01)
    exact = schedule_sim.simulate(p, m, v, 0.5 / v, bwd / v, comm).makespan
    assert step_time.pipeline(p, m, v, 0.5, bwd, comm) == pytest.approx(exact, rel=1e-9)
  assert step_time.pipeline(1, m, 1, 0.5, 1.0, 0.0) == m * 1.5


def _config(**strategy):
  c = llama3_8b.get_config()
  c.precision.type, c.device = 'mixed_precision', 'cuda'
  c.data.global_batch_size = 64
  for k, v in strategy.items():
    c.distributed_strategy[k] = v
  return c


def test_terms_follow_the_layout():
  base = step_time.predict(_config(), H100, 8)
  assert base.terms['tp_comm'] == base.terms['pp_comm'] == base.terms['bubble'] == base.terms['zero1_gather'] == 0
  assert base.terms['dp_comm'] > 0
  # half the ranks per replica: each does twice the micro batches
  assert step_time.predict(_config(), H100, 16).terms['compute'] == pytest.approx(base.terms['compute'] / 2)
  no_overlap = step_time.predict(_config(overlap_grad_reduce=False), H100, 8)
  assert no_overlap.terms['dp_comm'] > base.terms['dp_comm']
  zero1 = step_time.predict(_config(zero1=True), H100, 8)
  assert zero1.terms['zero1_gather'] > 0 and zero1.terms['optimizer'] == pytest.approx(base.terms['optimizer'] / 8)
  tp = step_time.predict(_config(tensor_model_parallel_size=4, kv_replicator=1), H100, 8)
  assert tp.terms['tp_comm'] > 0
  pp = step_time.predict(_config(pipeline_model_parallel_size=4), H100, 8)
  assert pp.terms['bubble'] > 0 and pp.terms['pp_comm'] > 0 and 0 < pp.bubble < 1


def _gemma3_270m(**strategy):
  # heads x head_dim 1024 against hidden 640, 15 of 18 layers sliding over 512 of 8192 tokens
  from tests import test_flop_count  # pylint: disable=import-outside-toplevel
  c = _config(**strategy)
  c.model = test_flop_count.gemma3_270m()
  return c


@pytest.mark.parametrize('make', [_config, _gemma3_270m], ids=['llama3_8b', 'gemma3_270m'])
def test_mfu_is_model_flops_over_peak(make):
  c = make()
  p = step_time.predict(c, H100, 8)
  per_token = flop_count.flops_per_token(c.model, c.data.seq_length)
  assert p.mfu == pytest.approx(per_token * p.tokens_per_s / (8 * H100.peak['bf16']))
  assert p.tokens_per_s == pytest.approx(c.data.global_batch_size * c.data.seq_length / p.step_s)
  assert p.step_s == pytest.approx(sum(p.terms.values()))     # one stage: no bubble, every term adds


def test_recompute_costs_compute():
  c = _config()
  plain = step_time.predict(c, H100, 8).terms['compute']
  c.model.activations_checkpoint_granularity = 'full'
  assert step_time.predict(c, H100, 8).terms['compute'] > plain * 1.25


SLOW = dataclasses.replace(H100, intra_bw=2e9)     # a link slow enough that the ring's sends show


def test_cp_divides_per_token_work_and_adds_the_ring():
  base = step_time.predict(_config(), SLOW, 8)
  c = _config(context_parallel_size=2)
  cp2 = step_time.predict(c, SLOW, 16)                # the same dp 8, each sequence over 2 ranks
  m, a = c.model, c.data
  b, s, heads, hd, layers = a.micro_batch_size, a.seq_length, m.num_attention_heads, transformer.head_dim(m), m.num_layers
  micro = a.global_batch_size // 8
  # everything per token halves; attention moves from the fused kernel (bf16, attn_eff) to the
  # ring's fp32 matmuls plus its score blocks' bytes, on half the causal work
  flops = 2 * b * s * s * heads * hd
  fused = flops / (SLOW.peak['bf16'] * SLOW.attn_eff)
  core = flops / 2 / (SLOW.peak['fp32'] * SLOW.matmul_eff) + b * heads * s * s / 4 * 48 / SLOW.mem_bw
  assert cp2.terms['compute'] == pytest.approx(base.terms['compute'] / 2 + micro * layers * 3 * (core - fused / 2))
  assert base.terms['cp_comm'] == 0 < cp2.terms['cp_comm']
  # the ring by hand: 2 steps per layer; the one forward send and the backward's K/V + dK/dV
  # send exceed their step's compute by what is exposed, and the last dK/dV hop is all exposed
  n, kv = b * s // 2, 2 * param_table.kv_heads(m) * hd
  bw, lat = SLOW.intra_bw * SLOW.link_eff, SLOW.intra_lat
  step = core / 2
  ring = (max(0, collective_cost.p2p(n * kv * 2, bw, lat) - step) + max(0, collective_cost.p2p(n * kv * 6, bw, lat) - 2 * step)
          + collective_cost.p2p(n * kv * 4, bw, lat))
  assert cp2.terms['cp_comm'] == pytest.approx(micro * m.num_layers * ring)
  # weight gradients reduce over dp x cp = 16 ranks: the all-reduce's ring is longer
  assert cp2.terms['dp_comm'] > base.terms['dp_comm']


def _moe(ep=1, **strategy):
  c = _config(expert_model_parallel_size=ep, **strategy)
  c.model.moe.update(num_experts=8, top_k=2, ffn_hidden_size=c.model.ffn_hidden_size // 2)
  return c


def test_moe_runs_the_active_experts_and_ep_adds_all_to_alls():
  c, dense = _moe(), step_time.predict(_config(), H100, 8)
  one = step_time.predict(c, H100, 8)
  m, a = c.model, c.data
  n, micro = a.micro_batch_size * a.seq_length, a.global_batch_size // 8
  # top-2 of experts half the MLP's width: the dense MLP's FLOPs, plus the router's (3 passes)
  router = 3 * 2 * n * m.moe.num_experts * m.hidden_size / (H100.peak['bf16'] * H100.matmul_eff)
  assert one.terms['compute'] == pytest.approx(dense.terms['compute'] + micro * m.num_layers * router)
  ep2 = step_time.predict(_moe(2), H100, 8)
  assert one.terms['ep_comm'] == 0 and ep2.terms['compute'] == pytest.approx(one.terms['compute'])
  bw, lat = collective_cost.link(H100, 2)
  a2a = collective_cost.all_to_all(n * m.moe.top_k * m.hidden_size * 2, 2, bw, lat)
  assert ep2.terms['ep_comm'] == pytest.approx(micro * m.num_layers * 4 * a2a)
  # half the experts per rank: less optimizer work, and their gradients reduce over 4 ranks, not 8
  assert ep2.terms['optimizer'] < one.terms['optimizer']
  assert step_time.predict(_moe(8), H100, 8).terms['optimizer'] < ep2.terms['optimizer']
  # TP splits the experts as the dense MLP: the MoE sublayer reduces its partial sums as the dense
  # MLP does, and every TP rank computes 1/tp of the experts (the router whole)
  tp2 = _config(tensor_model_parallel_size=2, kv_replicator=1)
  moe_tp = step_time.predict(_moe(tensor_model_parallel_size=2, kv_replicator=1), H100, 8)
  dense_tp = step_time.predict(tp2, H100, 8)
  micro_tp2 = a.global_batch_size // (a.micro_batch_size * 4)              # dp 4
  outside = micro_tp2 * sum(micro_batch_cost.edge_comm(tp2, H100, 2))
  assert outside > 0
  assert moe_tp.terms['tp_comm'] == pytest.approx(dense_tp.terms['tp_comm'])
  assert moe_tp.terms['compute'] == pytest.approx(dense_tp.terms['compute'] + micro_tp2 * m.num_layers * router)
  # under full recompute the backward runs the forward's two all-to-alls again
  c = _moe(2)
  c.model.activations_checkpoint_granularity = 'full'
  assert step_time.predict(c, H100, 8).terms['ep_comm'] == pytest.approx(ep2.terms['ep_comm'] * 1.5)


def test_local_entry_round_trips(tmp_path, caplog):
  entry = dataclasses.replace(clusters.LOCAL_DEFAULT, peak={'fp32': 1e11, 'bf16': 5e9}, source='measured')
  path = clusters.write_local(entry, str(tmp_path / 'local.json'))
  assert clusters.local(path) == entry
  assert clusters.local(str(tmp_path / 'missing.json')) == clusters.LOCAL_DEFAULT
  # a file another version wrote: a figure this one does not know is dropped, a missing one named
  with open(path) as f:
    fields = json.load(f)
  with open(path, 'w') as f:
    json.dump(dict(fields, figure_from_a_newer_version=1.0), f)
  assert clusters.local(path) == entry
  assert 'ignoring figure_from_a_newer_version' in caplog.text
  with open(path, 'w') as f:
    json.dump({k: v for k, v in fields.items() if k != 'peak'}, f)
  with pytest.raises(ValueError, match='peak.*re-run python -m tools.plan --calibrate'):
    clusters.local(path)


def test_the_startup_summary_prints_this_model():
  import torch  # pylint: disable=import-outside-toplevel
  from estimates import summary  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes
  c = _config(tensor_model_parallel_size=8)
  c.trainer.plan_cluster = 'h100'
  mesh = meshes.Mesh(tp=8, device=torch.device('cpu'))
  assert summary.step_line(c, mesh) == (f'step time (predicted on 8 devices, 1 h100 node): {step_time.predict(c, H100, 8).line()} '
                                        '| python -m tools.plan ranks the other layouts')
  c.trainer.plan_cluster = 'none'
  assert 'set trainer.plan_cluster' in summary.step_line(c, mesh)


def test_the_summary_counts_nodes_as_nodes():
  from estimates import summary  # pylint: disable=import-outside-toplevel
  trn1 = clusters.CLUSTERS['trn1.32xlarge']
  assert summary.on_cluster(trn1, 1024) == '1,024 devices, 32 trn1.32xlarge nodes'
  assert summary.on_cluster(trn1, 16) == '16 devices, 1 trn1.32xlarge node'
  assert summary.on_cluster(H100, 1) == '1 device, 1 h100 node'


@pytest.mark.parametrize('axis', ['cp', 'ep'])
def test_the_startup_summary_predicts_cp_and_ep(axis):
  import torch  # pylint: disable=import-outside-toplevel
  from estimates import summary  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes
  c = _config(context_parallel_size=2) if axis == 'cp' else _moe(2)
  c.trainer.plan_cluster = 'h100'
  mesh = meshes.Mesh(dp=8 if axis == 'cp' else 16, cp=2 if axis == 'cp' else 1, device=torch.device('cpu'))
  p = step_time.predict(c, H100, 16)
  assert p.terms[f'{axis}_comm'] > 0
  assert summary.step_line(c, mesh) == (f'step time (predicted on 16 devices, 2 h100 nodes): {p.line()} '
                                        '| python -m tools.plan ranks the other layouts')


def test_dry_run_of_an_ep_run_splits_the_experts_and_predicts():
  from configs import mixtral_tiny, validate  # pylint: disable=import-outside-toplevel
  from estimates import summary  # pylint: disable=import-outside-toplevel
  c = mixtral_tiny.get_config()
  c.trainer.plan_cluster = 'h100'
  text = {}
  for ep in (1, 2):
    c.distributed_strategy.expert_model_parallel_size = ep
    text[ep] = summary.dry_run(c, 2, validate.check)
  on_rank = {ep: int(t.split(' on this rank')[0].rsplit(', ', 1)[-1].replace(',', '')) for ep, t in text.items()}
  experts = 4 * 8 * 3 * 176 * 128        # llama_tiny's 4 layers x 8 experts x 3 h f: half of them move off the rank
  assert on_rank[1] - on_rank[2] == experts // 2
  assert 'ep=2 (experts over dp)' in text[2] and 'ep=' not in text[1].split('\n')[0]
  c.distributed_strategy.expert_model_parallel_size = 2
  assert f'step time (predicted on 2 devices, 1 h100 node): {step_time.predict(c, H100, 2).line()}' in text[2]


def test_measured_overheads_and_elementwise_rates_add_what_they_say():
  """--calibrate's terms for `local` (tools/plan_calibrate.py): framework overhead per layer and
  micro batch, per layer and step, per micro batch and per step; elementwise bytes at ew_bw and
  the head's logits at logit_s, in place of the streaming-bandwidth terms."""
  c = llama_tiny.get_config()
  c.device, c.precision.type = 'cpu', 'fp32'
  m, a = c.model, c.data
  layers, micro = m.num_layers, a.global_batch_size // a.micro_batch_size
  local = clusters.LOCAL_DEFAULT
  base = step_time.predict(c, local, 1).step_s
  over = dataclasses.replace(local, layer_overhead=1e-3, layer_step_overhead=2e-3, micro_overhead=3e-3,
                             step_overhead=4e-3)
  assert step_time.predict(c, over, 1).step_s - base == pytest.approx(
      layers * micro * 1e-3 + layers * 2e-3 + micro * 3e-3 + 4e-3)
  ew_bytes = 3 * layers * micro * sum(micro_batch_cost.elementwise_bytes(c, 1))
  logits = micro * a.micro_batch_size * a.seq_length * param_table.padded_vocab_size(m, 1)
  rates = dataclasses.replace(local, ew_bw=1e9, logit_s=1e-8)
  assert step_time.predict(c, rates, 1).step_s - base == pytest.approx(
      ew_bytes * (1 / 1e9 - 1 / local.mem_bw) + logits * (1e-8 - 24 / local.mem_bw))


def test_tp_collectives_are_counted_per_sublayer_on_measured_curves():
  curve = [[8, 4e-4], [524288, 2.4e-3], [16777216, 1.2e-2]]
  local = dataclasses.replace(clusters.LOCAL_DEFAULT, op_times={'all_reduce': curve})
  c = llama_tiny.get_config()
  c.device, c.precision.type = 'cpu', 'fp32'
  c.distributed_strategy.tensor_model_parallel_size = 2
  m, a = c.model, c.data
  n = a.micro_batch_size * a.seq_length
  per_call = collective_cost.collective(local, 'all_reduce', n * m.hidden_size * 4, 2)
  per_token = collective_cost.collective(local, 'all_reduce', n * 4, 2)
  micro = a.global_batch_size // a.micro_batch_size
  # 2 sublayers x forward and backward, each layer, each micro batch; outside the layers the
  # embedding's sum, the head input's gradient sum and the loss's three per-token reductions
  assert step_time.predict(c, local, 2).terms['tp_comm'] == pytest.approx(
      micro * ((4 * m.num_layers + 2) * per_call + 3 * per_token))


@pytest.mark.parametrize('sp, per_layer, outside', [(False, 4, 5), (True, 8, 7)])
def test_each_blocking_tp_collective_waits_sync_wait(sp, per_layer, outside):
  """local's sync_wait (fitted by --calibrate from tp2 steps) once per blocking TP/SP collective:
  plain TP 4 per layer (a sum per sublayer, forward and backward) and 5 outside the layers; SP
  twice the layers' (a gather and a reduce-scatter each) and 7 outside."""
  c = llama_tiny.get_config()
  c.device, c.precision.type = 'cpu', 'fp32'
  c.distributed_strategy.tensor_model_parallel_size, c.distributed_strategy.sequence_parallel = 2, sp
  micro = c.data.global_batch_size // c.data.micro_batch_size
  calls = micro * (per_layer * c.model.num_layers + outside)
  assert step_time.blocking_tp_calls(c, clusters.LOCAL_DEFAULT, 2) == pytest.approx(calls)
  waits = dataclasses.replace(clusters.LOCAL_DEFAULT, sync_wait=1e-3)
  assert (step_time.predict(c, waits, 2).step_s - step_time.predict(c, clusters.LOCAL_DEFAULT, 2).step_s
          == pytest.approx(calls * 1e-3))
  c.distributed_strategy.tensor_model_parallel_size, c.distributed_strategy.sequence_parallel = 1, False
  assert step_time.predict(c, waits, 2).terms == step_time.predict(c, clusters.LOCAL_DEFAULT, 2).terms  # no TP


def test_on_xla_backward_tp_collectives_hide_behind_weight_gradients():
  """One graph per step (Neuron: collectives on their own cores): the backward's input-gradient
  collectives overlap the weight-gradient GEMMs; eager code blocks on them."""
  c = _config(tensor_model_parallel_size=8, kv_replicator=1)
  eager = step_time.predict(c, H100, 8).terms
  graph = step_time.predict(c, dataclasses.replace(H100, device='xla'), 8).terms
  assert graph['compute'] == pytest.approx(eager['compute'])
  assert 0 < eager['tp_comm'] - graph['tp_comm'] < eager['tp_comm'] / 2
