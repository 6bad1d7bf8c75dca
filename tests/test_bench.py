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


def test_bench_hf_trains_the_same_model_on_both_sides():
  """tools/bench_hf.py compares like with like: from the same weights on the same batches,
  transformers' Llama and flatron take the same losses step after step (fp32)."""
  pytest.importorskip('transformers')
  from tools import bench_hf  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  c.trainer.gradient_clip_val = 1.0
  c.model.use_scaled_init_method = False
  r = bench_hf.run('fp32', steps=2, warmup=1, config=c)
  assert r['hf'] > 0 and r['flatron'] > 0 and r['flatron_bytes'] > 0 and r['hf_bytes'] > 0
  assert r['losses']['hf'] == pytest.approx(r['losses']['flatron'], rel=1e-5)
  assert r['losses']['flatron'][-1] < r['losses']['flatron'][0]
