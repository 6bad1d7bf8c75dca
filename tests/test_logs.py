"""logs.py: which ranks print and with what prefix, metrics records (null for non-finite, no
duplicates after a resume), and the step lines read one step late."""
import json
import os
import types

from absl import logging as absl_logging
import pytest
import torch

import logs
from configs import base
from parallel import mesh as meshes


@pytest.mark.parametrize('rank,local_rank,rank_0_only,info', [
    (0, 0, True, True), (2, 0, True, False), (2, 0, False, True), (3, 1, False, False)])
def test_info_lines_on_rank_0_or_every_local_rank_0_and_other_ranks_prefixed(caplog, rank, local_rank, rank_0_only,
                                                                            info):
  level = absl_logging.get_absl_logger().level      # restored as it was (set_verbosity would pin it)
  try:
    absl_logging.set_verbosity(absl_logging.INFO)
    logs.configure_logging(rank, local_rank, rank_0_only)
    with caplog.at_level('INFO'):
      absl_logging.info('step %d/%d', 1, 2)
      absl_logging.warning('careful')
  finally:
    logs.configure_logging(0, 0, True)
    absl_logging.get_absl_logger().setLevel(level)
  prefix = f'[rank {rank}] ' if rank else ''
  assert caplog.messages == [prefix + 'step 1/2'] * info + [prefix + 'careful']


def test_metrics_write_null_for_non_finite_numbers_and_drop_steps_after_a_resume(tmp_path):
  log = logs.MetricsLog(str(tmp_path), lead=True, tensorboard=False)
  for step in (1, 2, 3):
    log.write({'step': step, 'loss': float('nan') if step == 2 else 1.0 / step, 'x': float('inf')})
  log.close()
  lines = open(tmp_path / 'metrics.jsonl').read().splitlines()
  assert json.loads(lines[1]) == {'step': 2, 'loss': None, 'x': None} and 'NaN' not in ''.join(lines)
  log = logs.MetricsLog(str(tmp_path), lead=True, tensorboard=False, resumed_at=1)
  log.write({'step': 2, 'loss': 0.5})
  log.close()
  assert [json.loads(line)['step'] for line in open(tmp_path / 'metrics.jsonl')] == [1, 2]


def test_metrics_are_written_by_the_lead_rank_only(tmp_path):
  log = logs.MetricsLog(str(tmp_path), lead=False, tensorboard=True)
  log.write({'step': 1, 'loss': 1.0})
  log.close()
  assert os.listdir(tmp_path) == []


class _Records:
  def __init__(self):
    self.records = []

  def write(self, record):
    self.records.append(record)


def _out(step, skipped=False):
  return {'loss': torch.tensor(float(step)), 'grad_norm': torch.tensor(0.5), 'lr': 1e-3,
          'skipped': torch.tensor(skipped), 'metrics': {'rewards/margins': torch.tensor(2.0 * step)}}


def _reporter(**trainer):
  c = base.get_config()
  c.trainer.update(trainer)
  log = _Records()
  return logs.StepReporter(c, meshes.Mesh(), log, (1e9, 'test'), c.trainer.max_steps, 0, 100), log


def test_each_step_is_read_after_the_next_is_dispatched_and_flush_reads_the_last():
  reporter, log = _reporter(max_steps=3, log_every_n_steps=1)
  reporter.add(0, _out(0), 8)
  assert log.records == []                               # step 1 is read once step 2 is dispatched
  reporter.add(1, _out(1), 16)
  assert [r['step'] for r in log.records] == [1]
  reporter.add(2, _out(2), 24)
  record = reporter.flush()
  assert [(r['step'], r['loss'], r['consumed_samples'], r['rewards/margins']) for r in log.records] == [
      (1, 0.0, 8, 0.0), (2, 1.0, 16, 2.0), (3, 2.0, 24, 4.0)]
  assert record == log.records[-1] and reporter.flush() == record     # nothing pending: no new line


def test_skipped_steps_are_counted_when_read_and_stop_at_the_limit():
  reporter, log = _reporter(max_steps=10, log_every_n_steps=5, nonfinite_policy='skip', max_consecutive_skips=2)
  reporter.add(0, _out(0, skipped=True), 8)
  reporter.add(1, _out(1, skipped=True), 16)         # reads step 1: one skip
  assert reporter.skips == 1 and log.records == []
  with pytest.raises(FloatingPointError, match=r'2 steps in a row .*\(the last: step 2\)'):
    reporter.add(2, _out(2), 24)


@pytest.mark.parametrize('every, expected', [(1, {1: 1.0, 2: 2.0, 3: 4.0, 4: 8.0}), (2, {2: 1.5, 4: 6.0}),
                                             (3, {3: 7 / 3, 4: 8.0})])
def test_each_line_times_its_own_steps_the_last_included(monkeypatch, every, expected):
  now = [100.0]
  monkeypatch.setattr(logs.time, 'perf_counter', lambda: now[0])
  reporter, log = _reporter(max_steps=4, log_every_n_steps=every)
  for step, seconds in enumerate((1.0, 2.0, 4.0, 8.0)):    # the CPU: each step has run when it is added
    now[0] += seconds
    reporter.add(step, _out(step), 8 * (step + 1))
    now[0] += 0.5                                          # between steps: not a step's time
  reporter.flush()
  got = {r['step']: r['step_time'] for r in log.records}
  # every line's time is its steps' own, with the pauses between them (none before the first)
  pauses = {1: {1: 0.0, 2: 0.5, 3: 0.5, 4: 0.5}, 2: {2: 0.25, 4: 0.5}, 3: {3: 1.0 / 3, 4: 0.5}}[every]
  assert got == pytest.approx({k: v + pauses[k] for k, v in expected.items()})


def test_whatever_else_a_step_returns_joins_the_record():
  """A step's extra scalars (param_norm, a fork's own) and dicts of them (the per-layer
  statistics) reach the record on logged steps, read with the rest; None is left out."""
  reporter, log = _reporter(max_steps=2, log_every_n_steps=1)
  for step in (0, 1):
    reporter.add(step, dict(_out(step), param_norm=torch.tensor(3.0), my_metric=torch.tensor(step + 0.5),
                            layer_stats={'grad_norm/layers.0': torch.tensor(0.25)}, unused=None), 8 * (step + 1))
  reporter.flush()
  assert [(r['param_norm'], r['my_metric'], r['grad_norm/layers.0']) for r in log.records] == [(3.0, 0.5, 0.25),
                                                                                              (3.0, 1.5, 0.25)]
  assert 'unused' not in log.records[0]
