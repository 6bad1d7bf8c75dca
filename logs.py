"""What a run reports: the console (which ranks print, [rank N] prefixes), metrics.jsonl and
TensorBoard (and W&B, MLflow: monitor/trackers.py), and the training steps' lines, read one step late.

    <workdir>/metrics.jsonl   one JSON object per record; non-finite numbers are written as null
    <workdir>/tensorboard/<name>/  event files of run `name` (exp_manager.create_tensorboard_logger),
                              with the run name also as a text summary

Only the lead rank touches these files; on the other ranks the writer is a no-op.
"""
import json
import logging
import math
import os
import sys
import time

from absl import logging as absl_logging
import torch

from parallel import device as devices, training, xla


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

  def __init__(self, workdir, lead, tensorboard, resumed_at=None, name='flatron', trackers=()):
    self.file = self.writer = None
    self.trackers = list(trackers)     # monitor/trackers.py's (W&B, MLflow): each record goes to them too
    if not lead:
      return
    self.path = path = os.path.join(workdir, 'metrics.jsonl')
    if resumed_at is not None:
      keep_records_up_to(path, resumed_at)
    self.file = open(path, 'ab' if resumed_at is not None else 'wb', buffering=0)
    self.failed = False
    if tensorboard:
      from torch.utils.tensorboard import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.tensorboard = tensorboard_dir(workdir, name)
      self.writer = SummaryWriter(self.tensorboard)
      self._tensorboard(self.writer.add_text, 'run_name', name, resumed_at or 0)

  def write(self, record):
    if self.file is None:
      return
    record = {k: _finite(v) for k, v in record.items()}
    if not os.path.exists(self.path):   # removed under the run (with its workdir?): not written to nowhere
      print(f'warning: {self.path} was removed during the run; writing it anew from step {record.get("step")} '
            '(the records before are gone)', file=sys.stderr)
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      self.file.close()
      self.file = open(self.path, 'ab', buffering=0)
    self._append((json.dumps(record, allow_nan=False) + '\n').encode())
    if self.writer:
      for key, value in record.items():
        if key != 'step' and isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tensorboard(self.writer.add_scalar, key, value, record['step'])
    for tracker in self.trackers:
      tracker.log(record)

  def destinations(self) -> str:
    """Where the records went, for the run's last line."""
    where = [f'metrics {self.path}'] if self.file is not None else []
    where += [f'TensorBoard {self.tensorboard}'] if self.writer else []
    return ' | '.join(where + [t.name for t in self.trackers if t.tracker is not None])

  def _append(self, line: bytes):
    """One whole record, or none: a write the disk refuses part way (full, read-only) is cut back
    off, and the error names the file (a file object's write names none)."""
    start = os.fstat(self.file.fileno()).st_size
    try:
      view = memoryview(line)
      while view:
        view = view[self.file.write(view):]
    except OSError as e:
      self.failed = True
      try:
        os.ftruncate(self.file.fileno(), start)
      except OSError:
        pass
      raise OSError(e.errno, e.strerror, self.path) from e

  def _tensorboard(self, call, *args):
    """A TensorBoard write; its writer thread's error (a full disk) named with the event file's folder."""
    try:
      call(*args)
    except OSError as e:
      self.failed = True
      raise OSError(e.errno, e.strerror, self.tensorboard) from e

  def close(self):
    for tracker in self.trackers:
      tracker.close()
    if self.file is not None:
      self.file.close()
    if self.writer:
      try:
        self.writer.close()
      except OSError as e:
        if not self.failed:        # the error already on its way is the one to report
          raise OSError(e.errno, e.strerror, self.tensorboard) from e


def every(step, n):
  """Whether a periodic action with period n (0 = never) is due after `step` steps."""
  return bool(n) and step % n == 0


def fmt_eta(seconds):
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


STEP_KEYS = ('loss', 'grad_norm', 'lr', 'skipped', 'metrics')   # what every step returns, read by name


class StepReporter:
  """Each training step's values read one step late: `add` keeps step s's device tensors and
  reads step s-1's in one transfer, after step s is dispatched, so the host never waits on the
  step it just launched (nanodo's pattern, on every device). `flush` reads the pending step
  now: before anything that needs the log in order (validation, a save, the end).

  Reading a step counts skipped updates (raising at trainer.max_consecutive_skips, or at once
  under nonfinite_policy=error) and, on log steps, writes the record and the step line."""

  def __init__(self, config, mesh, log, peak, total, start_step, flops_per_token):
    self.config, self.mesh, self.log, self.total = config, mesh, log, total
    self.tokens_per_step = config.data.global_batch_size * config.data.seq_length
    self.flops_per_token, self.peak = flops_per_token, peak[0] * mesh.world_size
    self.pending, self.record, self.skips = None, {}, 0
    self.window_start, self.window_steps = time.perf_counter(), 0
    self.first_logged = start_step + 2      # XLA compiles the step's graphs by then (step 2 retraces once)
    self.compiled = None

  def add(self, step, out, consumed_samples):
    """Keep step `step`'s outputs (device tensors); read the step before it."""
    previous, self.pending = self.pending, (step, out, consumed_samples, devices.step_done_marker(self.mesh.device))
    if previous is not None:
      self._read(*previous)

  def flush(self):
    if self.pending is not None:
      pending, self.pending = self.pending, None
      self._read(*pending)
    return self.record

  def restart_window(self):
    """After validation or a save: its time is not training throughput, nor its graphs recompiles."""
    self.window_start, self.window_steps = time.perf_counter(), 0
    if self.compiled is not None:
      self.compiled = xla.compiles()

  def _read(self, step, out, consumed_samples, done):
    t = self.config.trainer
    logged = every(step + 1, t.log_every_n_steps) or step + 1 == self.total
    values = {'skipped': out['skipped']}          # every step: the skip count needs it
    if logged:
      values.update(loss=out['loss'], grad_norm=out['grad_norm'], **out['metrics'])
      # whatever else the step returned (param_norm, parallel/layer_stats.py's dict, a fork's
      # own): scalars, or dicts of them, into the record, in the same one read
      for key, value in out.items():
        if key not in STEP_KEYS and value is not None:
          values.update(value if isinstance(value, dict) else {key: value})
    host = devices.to_host({k: v for k, v in values.items() if torch.is_tensor(v)})   # one transfer
    scalars = {k: host.get(k, v) for k, v in values.items()}
    skipped = bool(scalars.pop('skipped'))
    self._count_skip(step, skipped)
    self.window_steps += 1
    if not logged:
      return
    # the steps since the last logged one, this one the last: from when this one finished (not
    # the next, already dispatched), so each line times its own steps
    finished = done()
    elapsed = (finished - self.window_start) / self.window_steps
    tokens_per_sec = self.tokens_per_step / elapsed
    record = {'step': step + 1, 'loss': float(scalars.pop('loss')), 'lr': out['lr'],
              'grad_norm': float(scalars.pop('grad_norm')), 'tokens_per_sec': tokens_per_sec,
              'mfu': tokens_per_sec * self.flops_per_token / self.peak,
              'step_time': elapsed, 'consumed_samples': consumed_samples}
    if skipped:
      record['skipped'] = True
    record.update({k: float(v) for k, v in scalars.items()})
    self._check_compiles(step, record)
    absl_logging.info('step %d/%d | loss %.4f | lr %.3e | grad_norm %.3f | %s tok/s | MFU %.2f%% | '
                      '%.3f s/step | ETA %s', step + 1, self.total, record['loss'], record['lr'],
                      record['grad_norm'], f'{tokens_per_sec:,.0f}', 100 * record['mfu'], elapsed,
                      fmt_eta(elapsed * (self.total - step - 1)))
    if out['metrics']:
      absl_logging.info('step %d | %s', step + 1, ' | '.join(f'{k} {record[k]:.4f}' for k in out['metrics']))
    self.log.write(record)
    self.record = record
    self.window_start, self.window_steps = finished, 0

  def _count_skip(self, step, skipped):
    t = self.config.trainer
    if skipped and t.nonfinite_policy == 'error':
      raise training.nonfinite_error(step)
    self.skips = self.skips + 1 if skipped else 0
    if skipped:
      absl_logging.warning('step %d: non-finite loss or gradient; update skipped (%d in a row, the limit '
                           'is trainer.max_consecutive_skips=%d)', step + 1, self.skips, t.max_consecutive_skips)
      if self.skips >= t.max_consecutive_skips:
        raise FloatingPointError(
            f'{self.skips} steps in a row had a non-finite loss or gradient (the last: step {step + 1}); '
            'lower model.optim.lr, check the data, or raise trainer.max_consecutive_skips')

  def _check_compiles(self, step, record):
    """XLA: the graph count, and a warning when it grew after the first steps."""
    if self.mesh.device.type != 'xla':
      return
    record['xla_compiles'] = compiles = xla.compiles()
    if self.compiled is not None and compiles > self.compiled:
      absl_logging.warning('step %d: XLA compiled %d new graph(s) since the last log step (a shape or '
                           'a Python value changed inside the step)', step + 1, compiles - self.compiled)
    if step + 1 >= self.first_logged:
      self.compiled = compiles
