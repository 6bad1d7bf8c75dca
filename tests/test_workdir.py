"""checkpoint/workdir.py: where the run directory is (explicit_log_dir, exp_dir/name,
--workdir), the exclusive workdir lock, metrics records (null for non-finite, no duplicates
after a resume), which ranks print and with what prefix."""
import json
import os
import socket
import subprocess
import sys

from absl import logging as absl_logging
import pytest

from checkpoint import workdir
from configs import base
from tests import procs


def named(explicit=None, exp_dir=None, exp_name=None):
  c = base.get_config()
  c.name = 'run7'
  c.exp_manager.explicit_log_dir, c.exp_manager.exp_dir, c.exp_manager.name = explicit, exp_dir, exp_name
  return c


def test_the_run_directory_is_explicit_log_dir_else_exp_dir_and_name_else_workdir():
  assert workdir.resolve(named(), 'runs/a') == 'runs/a'
  assert workdir.resolve(named(exp_dir='exps'), None) == os.path.join('exps', 'run7')     # the top-level name
  assert workdir.resolve(named(exp_dir='exps', exp_name='trial'), None) == os.path.join('exps', 'trial')
  assert workdir.resolve(named(explicit='logs/x', exp_dir='exps'), None) == 'logs/x'     # used exactly
  assert workdir.resolve(named(explicit='logs/x'), 'logs/x/') == 'logs/x'                # the same directory
  with pytest.raises(workdir.WorkdirError, match='pass --workdir, or set --config.exp_manager.explicit_log_dir '
                     r'\(used as it is\) or --config.exp_manager.exp_dir'):
    workdir.resolve(named(), None)
  with pytest.raises(workdir.WorkdirError, match='--workdir=runs/a differs from exp_manager.explicit_log_dir = logs/x'):
    workdir.resolve(named(explicit='logs/x'), 'runs/a')
  with pytest.raises(workdir.WorkdirError, match=r'differs from exp_manager.exp_dir \(\+ name\) = exps/run7'):
    workdir.resolve(named(exp_dir='exps'), 'runs/a')


@pytest.mark.parametrize('rank,local_rank,rank_0_only,info', [
    (0, 0, True, True), (2, 0, True, False), (2, 0, False, True), (3, 1, False, False)])
def test_info_lines_on_rank_0_or_every_local_rank_0_and_other_ranks_prefixed(caplog, rank, local_rank, rank_0_only,
                                                                            info):
  level = absl_logging.get_absl_logger().level      # restored as it was (set_verbosity would pin it)
  try:
    absl_logging.set_verbosity(absl_logging.INFO)
    workdir.configure_logging(rank, local_rank, rank_0_only)
    with caplog.at_level('INFO'):
      absl_logging.info('step %d/%d', 1, 2)
      absl_logging.warning('careful')
  finally:
    workdir.configure_logging(0, 0, True)
    absl_logging.get_absl_logger().setLevel(level)
  prefix = f'[rank {rank}] ' if rank else ''
  assert caplog.messages == [prefix + 'step 1/2'] * info + [prefix + 'careful']


def test_a_second_run_on_a_workdir_fails_naming_the_holder(tmp_path):
  lock = workdir.Lock(str(tmp_path))
  try:
    with pytest.raises(workdir.WorkdirInUse,
                       match=f'workdir {tmp_path} is in use by PID {os.getpid()} on host {socket.gethostname()}'):
      workdir.Lock(str(tmp_path))
  finally:
    lock.release()
  workdir.Lock(str(tmp_path)).release()          # free again once released


def test_the_lock_of_a_dead_process_never_blocks(tmp_path):
  holder = ('import sys, time; sys.path.insert(0, "."); from checkpoint import workdir; '
            f'workdir.Lock({str(tmp_path)!r}); print("locked", flush=True); sys.stdin.read()')
  with procs.started([sys.executable, '-c', holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True) as proc:
    assert proc.stdout.readline().strip() == 'locked'
    with pytest.raises(workdir.WorkdirInUse, match=f'PID {proc.pid}'):
      workdir.Lock(str(tmp_path))
    procs.kill_group(proc)                         # dies holding it: the kernel drops the lock
  workdir.Lock(str(tmp_path)).release()


def test_the_train_loop_refuses_a_locked_workdir(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  from tests import parity  # pylint: disable=import-outside-toplevel
  lock = workdir.Lock(str(tmp_path))
  try:
    with pytest.raises(workdir.WorkdirInUse):
      train.run(parity.parity_config(), str(tmp_path))
    assert not os.path.exists(tmp_path / 'metrics.jsonl')
  finally:
    lock.release()


def test_metrics_write_null_for_non_finite_numbers_and_drop_steps_after_a_resume(tmp_path):
  log = workdir.MetricsLog(str(tmp_path), lead=True, tensorboard=False)
  for step in (1, 2, 3):
    log.write({'step': step, 'loss': float('nan') if step == 2 else 1.0 / step, 'x': float('inf')})
  log.close()
  lines = open(tmp_path / 'metrics.jsonl').read().splitlines()
  assert json.loads(lines[1]) == {'step': 2, 'loss': None, 'x': None} and 'NaN' not in ''.join(lines)
  log = workdir.MetricsLog(str(tmp_path), lead=True, tensorboard=False, resumed_at=1)
  log.write({'step': 2, 'loss': 0.5})
  log.close()
  assert [json.loads(line)['step'] for line in open(tmp_path / 'metrics.jsonl')] == [1, 2]


def test_metrics_are_written_by_the_lead_rank_only(tmp_path):
  log = workdir.MetricsLog(str(tmp_path), lead=False, tensorboard=True)
  log.write({'step': 1, 'loss': 1.0})
  log.close()
  assert os.listdir(tmp_path) == []
