"""tools/bench.py reports figures that agree with each other and with the FLOPs formula; every
tool imports beside train.py (and the others) without defining a flag."""
import importlib
import os

from absl import flags
import pytest

from configs import llama_tiny
from model import transformer
from tools import bench

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tools')


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
  ceilings = iter([(3.0, 2.0, 1.0), (1.0, 0.5, 0.5), (2.0, 1.0, 1.0)])
  r = bench_hf.run('fp32', steps=2, warmup=1, config=c, ceiling=lambda: next(ceilings))
  assert r['ceiling'] == (1.0, 0.5, 0.5)      # one per timed step (2); the lower median: the stricter ceiling
  assert next(ceilings) == (2.0, 1.0, 1.0)
  assert r['hf'] > 0 and r['flatron'] > 0 and r['flatron_bytes'] > 0 and r['hf_bytes'] > 0
  assert r['losses']['hf'] == pytest.approx(r['losses']['flatron'], rel=1e-5)
  assert r['losses']['flatron'][-1] < r['losses']['flatron'][0]


def test_importing_the_tools_defines_no_flags():
  """A test process imports train.py and several tools: their flags exist only under
  `python -m tools.X`, so none can clash (DuplicateFlagError) with train.py's or another's."""
  import train  # pylint: disable=import-outside-toplevel,unused-import
  before = set(flags.FLAGS)
  names = sorted(n[:-3] for n in os.listdir(TOOLS) if n.endswith('.py') and n != '__init__.py')
  modules = [importlib.import_module(f'tools.{name}') for name in names]
  assert set(flags.FLAGS) == before
  assert all(hasattr(m, 'define_flags') for m in modules)       # what `python -m tools.X` calls first

