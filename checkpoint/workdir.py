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
from user_errors import UserError


class WorkdirInUse(UserError, RuntimeError):
  pass


class WorkdirError(UserError, ValueError):
  """No run directory, or two that disagree."""


class Lock:
  """An exclusive lock on `workdir` for the life of the run (release() or process exit)."""

  def __init__(self, workdir):
    if os.path.exists(workdir) and not os.path.isdir(workdir):
      raise WorkdirError(f'workdir {workdir} is a file, not a directory; choose another --workdir')
    self.workdir, self.created = workdir, not os.path.exists(workdir)
    try:
      os.makedirs(workdir, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:     # a file on the way to it
      raise WorkdirError(f'workdir {workdir}: {e.strerror} ({e.filename}); choose another --workdir') from None
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

  def release(self, unused=False):
    """Drop the lock; with `unused` (the run failed before writing anything) also remove the
    workdir this lock created, when nothing but empty directories and the lock are in it."""
    if self.fd is not None:
      os.close(self.fd)            # closing drops the flock
      self.fd = None
    if unused and self.created and os.path.isdir(self.workdir):    # (removed under the run: nothing to tidy)
      if os.path.exists(self.path):
        os.remove(self.path)
      for root, dirs, files in os.walk(self.workdir, topdown=False):
        if files or any(os.path.exists(os.path.join(root, d)) for d in dirs):
          return
        os.rmdir(root)


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
