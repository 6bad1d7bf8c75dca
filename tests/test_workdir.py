"""checkpoint/workdir.py: where the run directory is (explicit_log_dir, exp_dir/name,
--workdir) and the exclusive workdir lock."""
import os
import socket
import subprocess
import sys

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
