"""Faults caused for real, end to end through train.py, not raised by a patched function: a disk
that fills (a small tmpfs) during a save and during the metrics writes, the checkpoint directory
remounted read-only or taken away from a user who is not root, a SIGKILL in the middle of an
async save, a rank stopped mid-collective. Each ends in the one line docs/failure-and-recovery.md
quotes, leaves no half-written step committed, and the next run resumes from the last good step.
Where this machine cannot cause a fault (mounting needs root; taking permissions away needs a
user other than root, or root to become one), the test says so and skips.

The run is paused (SIGSTOP) while the fault is made, so that it lands between two saves."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests import procs

NOBODY = 65534
TINY = ['--config=configs/llama_tiny.py:test', '--config.trainer.val_check_interval=0',
        '--config.exp_manager.create_tensorboard_logger=False']
SAVING = ['--config.exp_manager.create_checkpoint_callback=True',
          '--config.exp_manager.checkpoint_callback_params.every_n_train_steps=2',
          '--config.exp_manager.checkpoint_callback_params.save_top_k=-1']
RESUME = ['--config.exp_manager.resume_if_exists=True', '--config.exp_manager.resume_ignore_no_checkpoint=True']
KEPT = 'this step is not committed and the last committed step is kept'


@contextlib.contextmanager
def tmpfs(path, size='16m'):
  """A tmpfs of `size` mounted at `path` for the test (root only; skips elsewhere)."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  os.makedirs(path, exist_ok=True)
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size},mode=0777', 'tmpfs', str(path)],
                           capture_output=True, text=True, check=False)
  if mounted.returncode:
    pytest.skip(f'mount refused: {mounted.stderr.strip()}')
  try:
    yield str(path)
  finally:
    subprocess.run(['umount', '-l', str(path)], check=False)


def remount(path, options):
  subprocess.run(['mount', '-o', f'remount,{options}', str(path)], check=True)


def fill(path):
  """Write zeros into `path`/filler until the disk is full; the file's path."""
  filler = os.path.join(path, 'filler')
  block = bytes(1 << 16)
  with open(filler, 'wb', buffering=0) as f:
    try:
      while True:
        f.write(block)
    except OSError as e:
      assert e.errno == 28, e
  return filler


@contextlib.contextmanager
def train(workdir, *flags, user=None, logs=None):
  """train.py started in its own process group, its stderr to `logs`/stderr.txt (default: beside the
  workdir); the Popen, with the log's path as `.log`."""
  logs = logs or os.path.dirname(str(workdir).rstrip('/'))
  args = [sys.executable, 'train.py', *TINY, f'--workdir={workdir}', *flags]
  if user is not None:
    args = ['setpriv', f'--reuid={user}', f'--regid={user}', '--clear-groups', *args]
  with open(os.path.join(logs, 'stderr.txt'), 'w') as err:
    with procs.started(args, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ, TMPDIR=logs)) as proc:
      proc.log = err.name
      yield proc


def finish(proc, timeout=240):
  """The run's exit status and the last line it printed."""
  proc.wait(timeout=timeout)
  with open(proc.log) as f:
    lines = f.read().splitlines()
  return proc.returncode, lines[-1] if lines else ''


def wait_for(condition, proc, timeout=240, poll=0.02, stop=True):
  """Poll until `condition()` holds, then (`stop`) stop the run (SIGSTOP) so the fault lands before
  its next step."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, 'timed out waiting for the run'
    try:                       # a join on the run for `poll` seconds: it returns early if the run ends
      proc.wait(timeout=poll)
    except subprocess.TimeoutExpired:
      continue
    assert condition(), 'the run ended before the fault could be made'
  if stop:
    os.kill(proc.pid, signal.SIGSTOP)


def committed(checkpoints):
  names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
  return sorted(int(n.split('_')[1]) for n in names
                if n.startswith('step_') and os.path.exists(os.path.join(checkpoints, n, 'COMMITTED')))


def steps_in(checkpoints):
  return sorted(n for n in os.listdir(checkpoints) if n.startswith('step_'))


def resumes_from(workdir, checkpoints, step, *flags, steps=10, user=None):
  """A fresh run on the same workdir resumes from `step` and trains to the end, each step logged once."""
  with train(workdir, *SAVING, *RESUME, f'--config.exp_manager.checkpoint_dir={checkpoints}', *flags,
             user=user) as proc:
    code, last = finish(proc)
    with open(proc.log) as f:
      printed = f.read()
  assert code == 0, last
  assert re.search(rf'resumed from \S+step_{step:08d}: step {step},' if step else 'no committed checkpoint', printed)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    logged = [json.loads(line)['step'] for line in f if '"loss"' in line]
  assert logged == list(range(1, steps + 1)), logged


def fault_after_the_first_commit(workdir, checkpoints, fault, user=None):
  """A run saving every 2 steps, paused once step 2 is committed while `fault()` is made; its exit
  status and last line (the save of step 4 meets the fault)."""
  with train(workdir, *SAVING, f'--config.exp_manager.checkpoint_dir={checkpoints}', user=user) as proc:
    wait_for(lambda: committed(checkpoints) == [2], proc)
    fault()
    os.kill(proc.pid, signal.SIGCONT)
    return finish(proc)


def test_a_disk_that_fills_during_a_save_says_so_keeps_the_last_commit_and_resumes(tmp_path):
  with tmpfs(tmp_path / 'disk') as disk:
    workdir, checkpoints = tmp_path / 'run', os.path.join(disk, 'checkpoints')
    filler = os.path.join(disk, 'filler')
    code, last = fault_after_the_first_commit(workdir, checkpoints, lambda: fill(disk))   # another writer takes the rest
    assert code == 2
    assert last == (f'error: no space left on {checkpoints}/step_00000004: {KEPT}; free space there, or set '
                    'exp_manager.checkpoint_dir to a larger disk')
    assert committed(checkpoints) == [2] and steps_in(checkpoints) == ['step_00000002']   # the half-written step went
    os.remove(filler)
    resumes_from(workdir, checkpoints, 2)


def test_a_workdir_on_a_disk_too_small_for_one_save_ends_in_one_line(tmp_path):
  """The whole workdir on a 4 MiB tmpfs, llama_tiny (13 MiB a step) saving every 2 steps."""
  with tmpfs(tmp_path / 'disk', size='4m') as disk:
    workdir = os.path.join(disk, 'run')
    args = [sys.executable, 'train.py', '--config=configs/llama_tiny.py', f'--workdir={workdir}', *SAVING,
            '--config.trainer.max_steps=4', '--config.trainer.val_check_interval=0', '--config.trainer.log_every_n_steps=1',
            '--config.data.global_batch_size=4', '--config.model.optim.sched.warmup_steps=1']
    out = procs.run(args, timeout=300)
    assert out.returncode == 2 and 'Traceback' not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        f'error: no space left on {workdir}/checkpoints/step_00000002: {KEPT}; free space there, or set '
        'exp_manager.checkpoint_dir to a larger disk')
    assert os.listdir(os.path.join(workdir, 'checkpoints')) == []
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      assert [json.loads(line)['step'] for line in f] == [1, 2]


@pytest.mark.parametrize('tensorboard', [False, True])
def test_a_disk_that_fills_under_the_metrics_stops_the_run_in_one_line(tmp_path, tensorboard):
  with tmpfs(tmp_path / 'disk') as disk:
    workdir = os.path.join(disk, 'run')
    flags = ['--config.trainer.max_steps=40', f'--config.exp_manager.create_tensorboard_logger={tensorboard}']
    metrics = os.path.join(workdir, 'metrics.jsonl')
    with train(workdir, *flags, logs=str(tmp_path)) as proc:
      wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, proc)
      fill(disk)
      os.kill(proc.pid, signal.SIGCONT)
      code, last = finish(proc)
    assert code == 2
    assert re.fullmatch(rf'error: {re.escape(workdir)}/(metrics\.jsonl|tensorboard/\S+): no space left on device; '
                        'free space there, or write to a larger disk', last), last
    with open(metrics) as f:     # every record whole
      assert all(json.loads(line) for line in f.read().splitlines())


def test_a_checkpoint_directory_remounted_read_only_mid_run_says_so_and_resumes(tmp_path):
  with tmpfs(tmp_path / 'disk') as disk:
    workdir, checkpoints = tmp_path / 'run', os.path.join(disk, 'checkpoints')
    code, last = fault_after_the_first_commit(workdir, checkpoints, lambda: remount(disk, 'ro'))
    assert code == 2
    assert last == (f'error: a read-only file system at {checkpoints}/step_00000004: {KEPT}; make it writable, or '
                    'set exp_manager.checkpoint_dir to a writable disk')
    assert committed(checkpoints) == [2]
    remount(disk, 'rw')
    resumes_from(workdir, checkpoints, 2)


def test_a_checkpoint_directory_taken_away_from_the_user_mid_run_says_so_and_resumes():
  """As a user who is not root (root writes anyway): root runs the training as `nobody`."""
  user = None if os.geteuid() != 0 else NOBODY
  if user is not None and subprocess.run(['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups', 'true'],
                                         capture_output=True, check=False).returncode:
    pytest.skip('root cannot become another user here (setpriv)')
  root = tempfile.mkdtemp(prefix='flatron-faults-')      # outside pytest's tmp_path, which only root may enter
  try:
    os.chmod(root, 0o777)
    checkpoints, workdir = os.path.join(root, 'checkpoints'), os.path.join(root, 'run')
    for d in (checkpoints, workdir):
      os.mkdir(d)
      if user is not None:
        os.chown(d, user, user)
    code, last = fault_after_the_first_commit(workdir, checkpoints, lambda: os.chmod(checkpoints, 0o555), user)
    assert code == 2
    assert last == (f'error: permission denied writing {checkpoints}/step_00000004: {KEPT}; check its permissions, '
                    'or set exp_manager.checkpoint_dir to a directory you can write')
    assert committed(checkpoints) == [2]
    os.chmod(checkpoints, 0o755)
    resumes_from(workdir, checkpoints, 2, user=user)
  finally:
    shutil.rmtree(root, ignore_errors=True)


def test_a_sigkill_during_an_async_save_leaves_only_whole_steps_and_resumes_from_the_last(tmp_path):
  workdir, checkpoints = tmp_path / 'run', str(tmp_path / 'run' / 'checkpoints')

  def writing():     # a step's directory made, its commit marker not yet written
    names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
    return any(not os.path.exists(os.path.join(checkpoints, n, 'COMMITTED')) for n in names if n.startswith('step_'))

  with train(workdir, *SAVING, '--config.exp_manager.async_checkpointing=True', '--config.trainer.max_steps=40') as proc:
    wait_for(writing, proc, poll=0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  assert writing()                   # killed mid-save: that step stays uncommitted
  whole = committed(checkpoints)
  resumes_from(workdir, checkpoints, whole[-1] if whole else 0, '--config.trainer.max_steps=40', steps=40)


def _worker(torchrun_pid, rank):
  """The pid of torchrun's worker of `rank` (its environment says RANK)."""
  with open(f'/proc/{torchrun_pid}/task/{torchrun_pid}/children') as f:
    children = [int(p) for p in f.read().split()]
  for pid in children:
    with open(f'/proc/{pid}/environ', 'rb') as f:
      if f'RANK={rank}'.encode() in f.read().split(b'\0'):
        return pid
  raise AssertionError(f'no worker of rank {rank} among {children}')


def test_a_rank_stopped_mid_run_fails_its_peer_in_one_line_and_the_run_resumes(tmp_path):
  """SIGSTOP to rank 1 of a dp2 run after its first commit: rank 0 gives up after the collective
  timeout naming itself, the operation and the ranks; the next run resumes from that commit."""
  workdir, checkpoints = tmp_path / 'run', str(tmp_path / 'run' / 'checkpoints')
  torchrun = [os.path.join(os.path.dirname(sys.executable), 'torchrun'), '--nproc_per_node=2', '--standalone']
  flags = [*TINY, f'--workdir={workdir}', *SAVING, '--config.distributed_strategy.collective_timeout_s=15']
  env = dict(os.environ, OMP_NUM_THREADS='1')
  with open(tmp_path / 'stderr.txt', 'w') as err:
    with procs.started([*torchrun, 'train.py', *flags], stdout=subprocess.DEVNULL, stderr=err, env=env) as proc:
      wait_for(lambda: committed(checkpoints) == [2], proc, stop=False)
      os.kill(_worker(proc.pid, 1), signal.SIGSTOP)
      proc.wait(timeout=240)
  printed = (tmp_path / 'stderr.txt').read_text()
  assert proc.returncode != 0
  # one line from rank 0 (torchrun prefixes its workers' lines), then torchrun's own report
  said = [line for line in printed.splitlines() if re.match(r'(\[rank\d\]: )?error: ', line)]
  assert len(said) == 1 and re.match(r'(\[rank0\]: )?error: rank 0: .+ over ranks \[0, 1\] failed: .*; another '
                                     'rank stopped, died or lost its network', said[0]), said
  assert not re.search(r'\[rank\d\]: Traceback', printed)
  assert committed(checkpoints) == [2]
  with open(tmp_path / 'stderr.txt', 'w') as err:
    with procs.started([*torchrun, 'train.py', *flags, *RESUME], stdout=subprocess.DEVNULL, stderr=err,
                       env=env) as proc:
      proc.wait(timeout=240)
  printed = (tmp_path / 'stderr.txt').read_text()
  assert proc.returncode == 0, printed[-3000:]
  assert re.search(r'resumed from \S+step_00000002: step 2,', printed)
  with open(workdir / 'metrics.jsonl') as f:
    assert [json.loads(line)['step'] for line in f if '"loss"' in line] == list(range(1, 11))
