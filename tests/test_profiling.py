"""monitor/profiling.py: a window of steps recorded on every rank asked for, one trace each that
TensorBoard's profile plugin (torch-tb-profiler) parses into its views; a run ending inside the
window writes what it recorded; settings that would record nothing are refused by name."""
import json
import os
import tempfile

import pytest

from configs import llama_tiny, validate
from tests import world

tb_profiler = pytest.importorskip('torch_tb_profiler')


def _config(**profiling):
  c = llama_tiny.get_config('test')
  c.trainer.max_steps, c.trainer.val_check_interval = 6, 0
  c.exp_manager.create_tensorboard_logger = False
  c.profiling.update(dict(dict(start_step=3, num_steps=2), **profiling))
  return c


def _train(workdir, profiling, data_parallel=False):
  import train  # pylint: disable=import-outside-toplevel
  c = _config(**profiling)
  c.distributed_strategy.zero1 = data_parallel
  train.run(c, workdir)


def _steps_in(path):
  with open(path) as f:
    events = json.load(f)['traceEvents']
  return sorted({e['name'] for e in events if e.get('name', '').startswith('train step ')}), events


def _tensorboard_views(path, worker):
  """What TensorBoard's profile plugin makes of a trace: its parser and run generator, as it loads a run."""
  from torch_tb_profiler.profiler.data import RunProfileData  # pylint: disable=import-outside-toplevel
  from torch_tb_profiler.profiler.run_generator import RunGenerator  # pylint: disable=import-outside-toplevel
  data = RunProfileData.parse(worker, 'steps3-4', path, tempfile.mkdtemp())
  return [v.name for v in RunGenerator(worker, 'steps3-4', data).generate_run_profile().views]


def test_a_window_writes_one_trace_per_rank_that_tensorboard_opens(tmp_path):
  world.run(_train, 2, str(tmp_path), {'ranks': (), 'record_shapes': True}, True)
  assert sorted(os.listdir(tmp_path / 'profile')) == ['rank0.steps3-4.pt.trace.json', 'rank1.steps3-4.pt.trace.json']
  for rank in (0, 1):
    path = str(tmp_path / 'profile' / f'rank{rank}.steps3-4.pt.trace.json')
    steps, events = _steps_in(path)
    assert steps == ['train step 3', 'train step 4']
    assert any(e.get('name') == 'aten::mm' and 'Input Dims' in e.get('args', {}) for e in events)   # shapes kept
    assert {'overall', 'operator', 'trace'} <= set(_tensorboard_views(path, f'rank{rank}'))


def test_only_the_ranks_asked_for_record(tmp_path):
  world.run(_train, 2, str(tmp_path), {'ranks': (1,)}, True)
  assert os.listdir(tmp_path / 'profile') == ['rank1.steps3-4.pt.trace.json']


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  c = _config(num_steps=4)            # steps 3-6 of a 4-step run
  c.trainer.max_steps, c.model.optim.sched.warmup_steps = 4, 1
  train.run(c, str(tmp_path))
  steps, _ = _steps_in(tmp_path / 'profile' / 'rank0.steps3-6.pt.trace.json')
  assert steps == ['train step 3', 'train step 4']


@pytest.mark.parametrize('settings,device,message', [
    ({'start_step': 7}, 'cpu', 'profiling.start_step=7 is after the run\'s last step (trainer.max_steps=6)'),
    ({'num_steps': 0}, 'cpu', 'profiling.num_steps=0 must be > 0'),
    ({'start_step': -1}, 'cpu', 'profiling.start_step=-1: give the first step to record'),
    ({}, 'xla', "profiling.start_step > 0 with device='xla'"),
    ({'cuda_memory_snapshot': True}, 'cpu', "profiling.cuda_memory_snapshot=True with device='cpu'"),
    ({'ranks': (0, 3)}, 'cpu', "profiling.ranks=(0, 3): [3] not among the run's 1 rank(s) (0..0)"),
])
def test_what_would_record_nothing_is_refused_by_name(settings, device, message):
  c = _config(**settings)
  c.device = device
  assert message in '\n'.join(validate.check(c))
  assert not any('profiling' in p for p in validate.check(_config()))
