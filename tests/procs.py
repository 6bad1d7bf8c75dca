"""Child processes for tests that never outlive the test: each starts in its own session
(process group), and the whole group is killed in a `finally`, pass or fail - torchrun's
workers included.

    out = procs.run([sys.executable, 'train.py', ...], timeout=240)   # CompletedProcess
    with procs.started([...]) as proc:                                 # a live Popen
      ...
"""
import contextlib
import os
import signal
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass                              # already gone, with its group
  proc.wait()


@contextlib.contextmanager
def started(args, **kwargs):
  kwargs.setdefault('cwd', ROOT)
  proc = subprocess.Popen(args, start_new_session=True, **kwargs)
  try:
    yield proc
  finally:
    kill_group(proc)
    for stream in (proc.stdout, proc.stderr):
      if stream is not None:
        stream.close()


def run(args, timeout, **kwargs):
  """subprocess.run with captured text output; on timeout the whole group is killed."""
  with started(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
