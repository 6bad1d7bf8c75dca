"""The run directory: an exclusive lock, the resolved config, metrics.jsonl and TensorBoard.

    <workdir>/.lock           PID and host of the run that holds it (fcntl.flock: the kernel
                              drops the lock when that process dies, so a stale file never blocks)
    <workdir>/config.json     the resolved config, written once the run has really started
    <workdir>/metrics.jsonl   one JSON object per record; non-finite numbers are written as null
    <workdir>/tensorboard/    event files (exp_manager.create_tensorboard_logger)

Only the lead rank touches these files; on the other ranks the writer is a no-op.
"""
import fcntl
import json
import math
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


def write_config(workdir, config):
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))


def _finite(value):
  return None if isinstance(value, float) and not math.isfinite(value) else value


def keep_records_up_to(path, step):
  """Drop records after `step` (a resumed run logs those steps again); atomic rewrite."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    kept = [line for line in f if line.strip() and json.loads(line).get('step', 0) <= step]
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.writelines(kept)
  os.replace(tmp, path)


class MetricsLog:
  """metrics.jsonl and TensorBoard scalars on the lead rank; a no-op elsewhere. `resumed_at`:
  the step a resumed run continues from (later records of the earlier run are dropped)."""

  def __init__(self, workdir, lead, tensorboard, resumed_at=None):
    self.file = self.writer = None
    if not lead:
      return
    path = os.path.join(workdir, 'metrics.jsonl')
    if resumed_at is not None:
      keep_records_up_to(path, resumed_at)
    self.file = open(path, 'a' if resumed_at is not None else 'w')
    if tensorboard:
      from torch.utils.tensorboard import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.writer = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, record):
    if self.file is None:
      return
    record = {k: _finite(v) for k, v in record.items()}
    self.file.write(json.dumps(record, allow_nan=False) + '\n')
    self.file.flush()
    if self.writer:
      for key, value in record.items():
        if key != 'step' and isinstance(value, (int, float)) and not isinstance(value, bool):
          self.writer.add_scalar(key, value, record['step'])

  def close(self):
    if self.file is not None:
      self.file.close()
    if self.writer:
      self.writer.close()
