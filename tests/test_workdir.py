"""checkpoint/workdir.py: the exclusive workdir lock, metrics records (null for non-finite,
no duplicates after a resume)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from checkpoint import workdir
from tests import procs


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
