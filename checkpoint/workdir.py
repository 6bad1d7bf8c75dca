"""The run directory: where it is, an exclusive lock, the resolved config, metrics.jsonl,
TensorBoard, and which ranks print.

    <workdir>/.lock           PID and host of the run that holds it (fcntl.flock: the kernel
                              drops the lock when that process dies, so a stale file never blocks)
    <workdir>/config.json     the resolved config, written once the run has really started
    <workdir>/metrics.jsonl   one JSON object per record; non-finite numbers are written as null
    <workdir>/tensorboard/<name>/  event files of run `name` (exp_manager.create_tensorboard_logger),
                              with the run name also as a text summary

The workdir is exp_manager.explicit_log_dir, else exp_manager.exp_dir/<exp_manager.name or
name> (NeMo's exp_manager, without its version sub-directory), else --workdir (`resolve`).
Only the lead rank touches these files; on the other ranks the writer is a no-op.
"""
import fcntl
import json
import logging
import math
import os
import socket

from absl import logging as absl_logging


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


def prints(rank, local_rank, rank_0_only) -> bool:
  """Whether a rank prints info lines (step lines, summaries): global rank 0, and with
  exp_manager.log_local_rank_0_only=False also every host's local rank 0."""
  return rank == 0 or (not rank_0_only and local_rank == 0)


_RECORDS = logging.getLogRecordFactory()     # the factory before configure_logging's


def configure_logging(rank, local_rank, rank_0_only):
  """Info lines on the printing ranks (`prints`), warnings only on the others. Every line of a
  rank other than 0 starts with [rank N], so one log holding several hosts reads apart (set in
  the record factory: absl's and the standard loggers, whatever handler prints them)."""
  prefix = f'[rank {rank}] ' if rank else ''

  def with_rank(*args, **kwargs):
    record = _RECORDS(*args, **kwargs)
    record.msg = prefix + str(record.msg)
    return record
  logging.setLogRecordFactory(with_rank if prefix else _RECORDS)
  if not prints(rank, local_rank, rank_0_only):
    absl_logging.set_verbosity(absl_logging.WARNING)


def tensorboard_dir(workdir, name):
  return os.path.join(workdir, 'tensorboard', name)


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
  """metrics.jsonl and TensorBoard scalars (run `name`) on the lead rank; a no-op elsewhere.
  `resumed_at`: the step a resumed run continues from (later records of the earlier run are
  dropped)."""

  def __init__(self, workdir, lead, tensorboard, resumed_at=None, name='flatron'):
    self.file = self.writer = None
    if not lead:
      return
    path = os.path.join(workdir, 'metrics.jsonl')
    if resumed_at is not None:
      keep_records_up_to(path, resumed_at)
    self.file = open(path, 'a' if resumed_at is not None else 'w')
    if tensorboard:
      from torch.utils.tensorboard import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.writer = SummaryWriter(tensorboard_dir(workdir, name))
      self.writer.add_text('run_name', name, resumed_at or 0)

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
