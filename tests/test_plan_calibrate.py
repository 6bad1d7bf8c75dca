"""tools/plan_calibrate.py's fits of overhead and elementwise rates and tools/bench_plan.py's configs (what is
predicted is what tools/bench_layouts.py runs). The measurement itself is a benchmark."""
import pytest

from tools import bench_layouts, bench_plan, plan_calibrate


def test_overhead_fit_recovers_its_terms():
  step, micro, layer_step, layer = 4e-4, 3e-4, 2e-4, 6e-4
  t = {(l, m): step + m * micro + l * layer_step + l * m * layer for l in (1, 3) for m in (1, 3)}
  got = plan_calibrate.fit_overhead(t)
  assert got == pytest.approx({'step': step, 'micro': micro, 'layer_step': layer_step, 'layer': layer})


def test_elementwise_fit_recovers_bandwidth_and_logit_cost():
  ew_bw, logit_s, mem_bw = 10e9, 8e-9, 60e9
  rows = [(3e8, 2e6), (3e8, 3.3e7)]                # the same layers, two vocabularies
  rest = [b / ew_bw + l * logit_s for b, l in rows]
  assert plan_calibrate.fit_elementwise(rows, rest, mem_bw) == pytest.approx({'ew_bw': ew_bw, 'logit_s': logit_s})
  # faster than streaming memory is noise: the datasheet terms stay
  fast = [b / 1e12 + l * 1e-13 for b, l in rows]
  assert plan_calibrate.fit_elementwise(rows, fast, mem_bw) == pytest.approx({'ew_bw': mem_bw, 'logit_s': 24 / mem_bw})


def test_sync_wait_fit_spreads_the_excess_over_the_collectives():
  assert plan_calibrate.fit_sync_wait(0.012, 24) == pytest.approx(5e-4)
  assert plan_calibrate.fit_sync_wait(-0.003, 24) == 0.0          # faster than predicted: no wait


@pytest.mark.parametrize('layout', sorted(bench_layouts.LAYOUTS))
def test_bench_plan_predicts_the_config_bench_layouts_runs(layout):
  c = bench_plan.layout_config('configs/llama_tiny.py', 'small', layout)
  d = c.distributed_strategy
  assert (c.model.num_layers, c.model.hidden_size, c.data.global_batch_size) == (4, 256, 16)
  assert d.tensor_model_parallel_size == (2 if layout.startswith('tp2') else 1)
  assert d.pipeline_model_parallel_size == (2 if layout.startswith('pp2') else 1)
  assert d.zero1 == ('zero' in layout) and d.sequence_parallel == layout.endswith('_sp')
  assert d.zero_stage == (int(layout.split('zero')[1][0]) if 'zero' in layout else 1)
  assert d.get('data_parallel_shard_size', 0) == (2 if 'hsdp2' in layout else 0)
  assert d.overlap_grad_reduce == ('no_overlap' not in layout)
