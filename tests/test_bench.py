"""tools/bench.py reports figures that agree with each other and with the FLOPs formula; every
tool imports beside train.py (and the others) without defining a flag; SIGTERM ends a tool through
its `finally`, so the children it started end with it."""
import importlib
import os
import signal
import subprocess
import sys

from absl import flags
import pytest

from configs import llama_tiny
from model import flop_count
from tests import procs
from tools import bench

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tools')


# heads x head_dim (4 x 16) past the hidden size (32), a sliding layer before a full one: the
# FLOPs the figures use count both
WINDOWED = {'head_dim': 16, 'sliding_window': 8, 'layer_types': ('sliding_attention', 'full_attention')}


@pytest.mark.parametrize('overrides', [{}, WINDOWED], ids=['llama_tiny', 'head_dim_and_window'])
def test_bench_figures_are_consistent(overrides):
  c = llama_tiny.get_config('test')
  c.model.update(overrides)
  r = bench.bench(c, steps=2, warmup=1)
  tokens = c.data.global_batch_size * c.data.seq_length
  assert r['tokens_per_step'] == tokens
  assert r['tokens_per_sec'] == pytest.approx(tokens / r['step_time'])
  assert r['flops'] == pytest.approx(r['tokens_per_sec'] * flop_count.flops_per_token(c.model, 16))
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
  runnable = [m for m in modules if "if __name__ == '__main__':" in open(m.__file__).read()]
  assert len(runnable) > 10
  assert all(hasattr(m, 'define_flags') for m in runnable)      # what `python -m tools.X` calls first



# A tool that ran its children in their own process group, as bench_layouts and bench_memory do.
_TOOL_WITH_A_CHILD = '''
import os, signal, subprocess, sys
import tools
tools.exit_on_sigterm()
child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)   # waits for a signal
try:
  print(child.pid, flush=True)
  child.wait()
finally:
  if child.poll() is None:
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
'''


def test_a_tool_stopped_by_sigterm_kills_its_children():
  with procs.started([sys.executable, '-c', _TOOL_WITH_A_CHILD], stdout=subprocess.PIPE, text=True) as tool:
    child = int(tool.stdout.readline())
    try:
      tool.send_signal(signal.SIGTERM)
      assert tool.wait(timeout=60) == 128 + signal.SIGTERM
      with pytest.raises(ProcessLookupError):      # killed and reaped by the tool's finally
        os.kill(child, 0)
    finally:
      try:
        os.killpg(child, signal.SIGKILL)
      except ProcessLookupError:
        pass
