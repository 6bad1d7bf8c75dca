"""step_trace.py: one rank's real step on fake tensors against the fake backend, its live
bytes (estimates/live_bytes.py) beside the estimate, and its failures in one line."""
import os
import sys

from absl import logging as absl_logging
import pytest
import torch

from configs import cli, llama_tiny, mixtral_tiny
from estimates import live_bytes, memory
from model import lora
from optim import sr_update, update
from parallel import mesh as meshes, tensor, training
import step_trace as trace
from tests import procs


def _tiny(tp=1, pp=1, zero1=False, **data):
  c = llama_tiny.get_config('test')
  c.device = 'cpu'
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.zero1 = tp, pp, zero1
  for k, v in data.items():
    c.data[k] = v
  return c


def _two_steps(config, counter, fake):
  """Two steps of `config` on one device under `counter` (LiveBytes or FakeLiveBytes): the
  second step's peak and its parts."""
  mesh = meshes.init(config)
  with counter as live, live.saving():
    params = training.init_params(config, mesh)
    live.hold(params.values(), 'params')
    updater = update.Updater(params, config, mesh, training.placement(config, mesh),
                             trainable=lora.trainable(config.model, params))
    ops = tensor.config_ops(config, mesh)
    loader = trace.stand_in.loader(config)
    for step in range(2):
      batches = loader.global_batch(step * config.data.global_batch_size)
      if fake:
        batches = [{k: live.from_tensor(v) for k, v in b.items()} for b in batches]
      training.train_step(params, updater, batches, config, step, mesh, ops)
      trace._classify(live, params, updater)  # pylint: disable=protected-access
      if step == 0:
        live.restart_peak()
    return live.peak, live.at_peak


def test_fake_tensors_count_the_bytes_real_ones_hold(monkeypatch):
  """The same step on real tensors (LiveBytes) and on fake ones (FakeLiveBytes). What the rank
  holds is equal to the byte; the step's own tensors within 1% (a few KiB of 800: a handful
  of small temporaries the real kernels make and fake ones do not, or the other way round).
  A trace runs the optimizer's kernels eagerly (dynamo does not trace under its modes): so
  does the real step here."""
  monkeypatch.setattr(sr_update, 'COMPILED_DEVICES', ())
  monkeypatch.setattr(sr_update, 'FP32_DEVICES', ())
  c = _tiny()
  (real, real_parts), (fake, fake_parts) = (_two_steps(c, live_bytes.LiveBytes(), fake=False),
                                            _two_steps(c, live_bytes.FakeLiveBytes(), fake=True))
  for part in live_bytes.HELD:
    assert real_parts[part] == fake_parts[part], part
  assert fake_parts['params'] == memory.estimate(c)['params'] and fake_parts['activations'] > 0
  assert abs(fake - real) < 0.01 * real and abs(fake_parts['activations'] - real_parts['activations']) < 0.01 * real
  assert fake == sum(fake_parts.values())


def test_a_traced_layout_lists_its_ranks_assumptions_and_sits_near_the_estimate():
  c = _tiny(tp=2, pp=2, zero1=True)
  level = absl_logging.get_absl_logger().level
  results = trace.trace(c, 8)
  assert absl_logging.get_absl_logger().level == level    # the run's own log lines show as before
  assert [r['where'] for r in results] == ['rank 0/8 = dp 0/2 pp 0/2 tp 0/2', 'rank 2/8 = dp 0/2 pp 1/2 tp 0/2']
  for r in results:
    rows = {name: (traced, estimated) for name, traced, estimated in trace.compare(r)}
    for part in ('params', 'grads'):        # what the rank holds is shapes alone: exactly the estimate's
      assert rows[part][0] == rows[part][1] > 0, (part, rows[part])
    assert abs(trace.off_by(*rows['total'])) < 0.1, rows['total']
    assert 'the finite check of the loss and grad norm (assumed finite)' in r['assumed']
  text, refusal = trace.report(results, (10**12, 'a big device'))
  assert refusal is None and text.count('memory: fits a big device') == 2
  text, refusal = trace.report(results, (2**20, 'a 1 MiB device'))
  assert refusal.startswith('the traced step does not fit a 1 MiB device (1.0 MiB): rank 0/8 = dp 0/2 pp 0/2 tp 0/2 '
                            'needs ')


def test_zero3_is_traced_with_its_boxes_gathered_and_freed():
  """At dp4 ZeRO-3 a rank holds its rows and, at the peak, the boxes gathered then: the
  estimate's params and gathered, to the byte. (The gradients' whole buffers are an upper bound:
  at this size one bucket holds a stage, and fewer are alive than the estimate's in flight.)"""
  c = _tiny(zero1=True)
  c.distributed_strategy.zero_stage = 3
  for r in trace.trace(c, 4):
    rows = {name: (traced, estimated) for name, traced, estimated in trace.compare(r)}
    assert rows['params'][0] == rows['params'][1] > 0, rows
    assert 0 < rows['grads'][0] <= rows['grads'][1], rows


def test_a_broken_layout_fails_in_the_trace_with_one_line_naming_rank_layout_and_operation():
  """tp 4 over 2 KV heads without a kv_replicator: validation refuses it before a run; traced
  anyway, the real code fails and the line says where."""
  c = _tiny(tp=4)
  with pytest.raises(trace.TraceError) as e:
    trace.trace(c, 4)
  line = str(e.value)
  assert '\n' not in line and line.startswith('trace of rank 0/4 = dp 0/1 pp 0/1 tp 0/4: ')
  assert '.py:' in line.split(': ')[1]       # flatron's own file and line of the failing operation


def test_moe_is_traced_with_its_routing_assumed_and_named():
  c = mixtral_tiny.get_config('test')
  c.device = 'cpu'
  c.distributed_strategy.expert_model_parallel_size = 2
  r, = trace.trace(c, 2)
  assert any(what.startswith('MoE: ') for what in r['assumed']), r['assumed']
  assert r['at_peak']['params'] == trace.tensor_estimate(r['estimate'])['params']


def test_the_micro_batches_traced_cover_the_schedule():
  c = _tiny(pp=4, global_batch_size=64, micro_batch_size=1)
  assert trace.schedule_micro_batches(c, 1) == (5, 64)        # 1F1B: warm-up, one steady round, cool-down
  c.distributed_strategy.virtual_pipeline_model_parallel_size = 2
  assert trace.schedule_micro_batches(c, 1) == (12, 64)       # interleaved: a multiple of pp
  assert trace.schedule_micro_batches(_tiny(global_batch_size=8, micro_batch_size=2), 4) == (1, 1)


def test_dry_run_is_a_boolean_flag_that_also_takes_trace():
  parse = cli.DryRunParser().parse
  assert [parse(v) for v in (True, 'true', 'trace', False, 'false')] == ['estimate', 'estimate', 'trace', '', '']
  with pytest.raises(ValueError, match='--dry_run=trace'):
    parse('yes please')


def test_train_dry_run_trace_prints_each_traced_rank_and_touches_nothing(tmp_path):
  out = procs.run([sys.executable, 'train.py', '--config=configs/llama_tiny.py:test', '--dry_run=trace',
                   f'--workdir={tmp_path / "w"}', '--config.distributed_strategy.pipeline_model_parallel_size=2',
                   '--config.device=cpu'], timeout=300, env=dict(os.environ, WORLD_SIZE='4'))
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'dry run: nothing was allocated' in out.stdout
  assert out.stdout.count('traced rank ') == 2 and 'of tensors, estimated' in out.stdout
  assert not (tmp_path / 'w').exists()


def test_the_fake_backend_needs_no_rendezvous_and_builds_every_group():
  c = _tiny(tp=8, pp=4)
  c.backend = 'fake'
  try:
    mesh = meshes.init(c, world=1024, rank=1000)
    assert (mesh.dp, mesh.pp_rank, mesh.tp_rank) == (32, 1, 0)
    assert torch.distributed.get_backend(mesh.host_group) == 'fake'
  finally:
    meshes.shutdown()


def test_an_nxd_file_traced_at_its_own_layout_sits_within_ten_percent_of_its_estimate():
  """NxD Training 2.26's Llama-3-8B pretraining file at its 128 ranks (tp 32, ZeRO-1 over dp 4),
  its model's config.json: the traced peak beside the estimate, and the same verdict on its trn1
  device (every file: python -m tools.trace_nxd, docs/dry-run-trace.md)."""
  from tools import trace_nxd  # pylint: disable=import-outside-toplevel
  config, world_size = trace_nxd.load('hf_llama3_8B_config.yaml')
  r, = trace.trace(config, world_size)
  assert r['where'] == 'rank 0/128 = dp 0/4 pp 0/1 tp 0/32'
  estimated = trace.tensor_estimate(r['estimate'])['total']
  assert abs(trace.off_by(r['peak'], estimated)) < 0.1, (r['peak'], estimated)
  _, refusal = trace.report([r], (16 * 2**30, 'a trn1 device'), another_device=True)
  assert refusal is None and r['estimate']['total'] < 16 * 2**30
