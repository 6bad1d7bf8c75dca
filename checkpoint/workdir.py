"""The run directory: where it is, an exclusive lock, and the resolved config (metrics.jsonl,
TensorBoard and the console: logs.py).

    <workdir>/.lock           PID and host of the run that holds it (fcntl.flock: the kernel
                              drops the lock when that process dies, so a stale file never blocks)
    <workdir>/config.json     the resolved config, written once the run has really started

The workdir is exp_manager.explicit_log_dir, else exp_manager.exp_dir/<exp_manager.name or
name> (NeMo's exp_manager, without its version sub-directory), else --workdir (`resolve`).
"""
import fcntl
import os
import socket


class WorkdirInUse(RuntimeError):
  pass


class Lock:
  """An exclusive lock on `workdir` for the life of the run (release() or process exit)."""

  def __init__(self, workdir):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, '.lock')
    self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(self.fd, 200).decode(errors='replace').split()
      os.close(self.fd)
      pid, host = (holder + ['?', '?'])[:2]
      raise WorkdirInUse(f'workdir {workdir} is in use by PID {pid} on host {host}; wait for that '
                         'run to end, stop it, or choose another --workdir') from None
    os.ftruncate(self.fd, 0)
    os.write(self.fd, f'{os.getpid()} {socket.gethostname()}\n'.encode())

  def release(self):
    if self.fd is not None:
      os.close(self.fd)            # closing drops the flock
      self.fd = None


class WorkdirError(ValueError):
  """No run directory, or two that disagree."""


def resolve(config, flag=None) -> str:
  """The run directory: explicit_log_dir exactly, else exp_dir/<exp_manager.name or name>, else
  `flag` (--workdir). A --workdir that names another directory is an error, as is none at all."""
  e = config.exp_manager
  configured, key = None, None
  if e.explicit_log_dir:
    configured, key = e.explicit_log_dir, 'exp_manager.explicit_log_dir'
  elif e.exp_dir:
    configured, key = os.path.join(e.exp_dir, e.name or config.name), 'exp_manager.exp_dir (+ name)'
  if configured is None and flag is None:
    raise WorkdirError('no run directory: pass --workdir, or set --config.exp_manager.explicit_log_dir '
                       '(used as it is) or --config.exp_manager.exp_dir (runs go to exp_dir/<name>)')
  if configured is not None and flag is not None and os.path.abspath(flag) != os.path.abspath(configured):
    raise WorkdirError(f'--workdir={flag} differs from {key} = {configured}; give only one of them '
                       '(or the same directory)')
  return configured if configured is not None else flag


def write_config(workdir, config):
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
