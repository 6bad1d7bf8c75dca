"""tools/bench.py reports figures that agree with each other and with the FLOPs formula."""
import pytest

from configs import llama_tiny
from model import transformer
from tools import bench


def test_bench_figures_are_consistent():
  c = llama_tiny.get_config('test')
  r = bench.bench(c, steps=2, warmup=1)
  tokens = c.data.global_batch_size * c.data.seq_length
  assert r['tokens_per_step'] == tokens
  assert r['tokens_per_sec'] == pytest.approx(tokens / r['step_time'])
  assert r['flops'] == pytest.approx(r['tokens_per_sec'] * transformer.flops_per_token(c.model, 16))
  assert r['mfu'] == pytest.approx(r['flops'] / r['peak'])
