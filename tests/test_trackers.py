"""monitor/trackers.py: W&B (offline) and MLflow (its file store) get every record metrics.jsonl
gets, read back with each package's own formats and readers; a resumed run continues their runs;
NxD's YAML keys turn them on; a tracker whose files vanish mid-run is reported once and dropped;
a missing package, or a server that does not answer, is refused at start-up by name."""
import glob
import json
import logging
import os
import shutil
import struct
import sys

import pytest

import logs
import train
from configs import nxd_yaml, validate
from monitor import trackers
from tests import procs
from tests.test_train import read_metrics, tiny_config

wandb = pytest.importorskip('wandb')
mlflow = pytest.importorskip('mlflow')
from mlflow.tracking import MlflowClient  # pylint: disable=wrong-import-position

BLOCK, HEADER = 32768, 7     # the .wandb log's blocks, and its file / chunk headers' size


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')


def wandb_runs(save_dir):
  """{run id: (config, {step: history row})} of the offline runs under `save_dir`, from their
  .wandb files: wandb's record log (a 7-byte header, 32 KiB blocks of chunks, each chunk's header
  crc32 / length / kind, FULL = 1 or FIRST.. LAST = 4), every record a wandb_internal_pb2.Record.
  wandb 0.31 ships no Python reader of its own; the Record schema is its."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  out = {}
  for path in sorted(glob.glob(os.path.join(save_dir, 'wandb', 'offline-run-*', 'run-*.wandb'))):
    data, pos, pending = open(path, 'rb').read(), HEADER, b''
    assert data[:4] == b':W&B'
    config, rows = {}, {}
    while pos + HEADER <= len(data):
      left = BLOCK - pos % BLOCK
      _, length, kind = struct.unpack('<IHB', data[pos:pos + HEADER])
      if left < HEADER or (length == 0 and kind == 0):
        pos += left
        continue
      pending += data[pos + HEADER:pos + HEADER + length]
      pos += HEADER + length
      if kind in (1, 4):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b''
        which = record.WhichOneof('record_type')
        if which == 'run':
          run_id = record.run.run_id
          config.update({u.key or '/'.join(u.nested_key): json.loads(u.value_json) for u in record.run.config.update})
        elif which == 'history':
          row = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
          rows.setdefault(record.history.step.num, {}).update(row)
    prior = out.get(run_id, ({}, {}))
    out[run_id] = ({**prior[0], **config}, {**prior[1], **rows})
  return out


def mlflow_metrics(uri, experiment):
  """(run, {key: {step: value}}) of the one run of `experiment`, through MlflowClient's search_runs
  and get_metric_history (mlflow.set_tracking_uri would also set MLFLOW_TRACKING_URI for later runs)."""
  client = MlflowClient(uri)
  [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
  return run, {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}


def _config(steps=6, **exp_manager):
  c = tiny_config(max_steps=steps, val_check_interval=3, num_sanity_val_steps=1)
  c.exp_manager.create_wandb_logger = c.exp_manager.create_mlflow_logger = True
  c.exp_manager.update(exp_manager)
  return c


def test_wandb_and_mlflow_hold_what_metrics_jsonl_holds(tmp_path):
  train.run(_config(), str(tmp_path))
  records = read_metrics(tmp_path)
  assert {'sanity_val_loss', 'loss', 'val_loss', 'grad_norm', 'lr'} <= {k for r in records for k in r}
  [(config, rows)] = wandb_runs(str(tmp_path)).values()
  run, metrics = mlflow_metrics('file:' + str(tmp_path / 'mlruns'), 'llama_tiny')
  checked = 0
  for record in records:
    for key, value in record.items():
      if key == 'step' or not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      assert rows[record['step']][key] == pytest.approx(value, rel=0, abs=0), (key, record['step'])
      assert metrics[key][record['step']] == value, (key, record['step'])
      checked += 1
  assert checked > 6 * 8 and sorted(metrics['loss']) == [1, 2, 3, 4, 5, 6]
  # the config once: W&B's run config and MLflow's parameters, flattened
  assert config['model.hidden_size'] == 32 and run.data.params['model.hidden_size'] == '32'
  assert run.info.status == 'FINISHED' and run.info.run_name == 'llama_tiny'


def test_a_resumed_run_continues_its_tracker_runs(tmp_path):
  c = _config(steps=4, create_checkpoint_callback=True)
  train.run(c, str(tmp_path))
  ids = json.loads((tmp_path / trackers.IDS_FILE).read_text())
  c = _config(steps=6, create_checkpoint_callback=True, resume_if_exists=True)
  train.run(c, str(tmp_path))
  assert json.loads((tmp_path / trackers.IDS_FILE).read_text()) == ids
  _, metrics = mlflow_metrics('file:' + str(tmp_path / 'mlruns'), 'llama_tiny')
  assert sorted(metrics['loss']) == [1, 2, 3, 4, 5, 6]
  runs = wandb_runs(str(tmp_path))
  assert list(runs) == [ids['wandb']] and {5, 6} <= set(runs[ids['wandb']][1])


def test_an_nxd_yaml_with_create_wandb_logger_logs_to_wandb(tmp_path):
  text = ('name: tracked\ntrainer:\n  max_steps: 3\n  log_every_n_steps: 1\nexp_manager:\n'
          '  create_tensorboard_logger: False\n  create_wandb_logger: True\n'
          '  wandb_logger_kwargs:\n    project: nxd-runs\n    name: llama-tiny\n    resume: True\n'
          'model:\n  num_layers: 2\n  hidden_size: 32\n  ffn_hidden_size: 64\n  num_attention_heads: 4\n'
          '  num_kv_heads: 2\n  optim:\n    sched:\n      warmup_steps: 1\n'
          'data:\n  seq_length: 16\n  micro_batch_size: 1\n  global_batch_size: 2\n')
  (tmp_path / 'c.yaml').write_text(text)
  mapped = nxd_yaml.load(str(tmp_path / 'c.yaml'))
  kw = mapped.config.exp_manager.wandb_logger_kwargs
  assert mapped.config.exp_manager.create_wandb_logger and (kw.project, kw.name) == ('nxd-runs', 'llama-tiny')
  assert any(key == 'exp_manager.wandb_logger_kwargs.resume' for key, _, _ in mapped.not_honoured)
  out = procs.run([sys.executable, 'train.py', f'--config=configs/nxd_yaml.py:{tmp_path / "c.yaml"}',
                   f'--workdir={tmp_path / "run"}'], timeout=300, env=dict(os.environ, WANDB_MODE='offline'))
  assert out.returncode == 0, out.stderr[-3000:]
  [(config, rows)] = wandb_runs(str(tmp_path / 'run')).values()
  losses = {r['step']: r['loss'] for r in read_metrics(tmp_path / 'run') if 'loss' in r}
  assert {s: rows[s]['loss'] for s in losses} == losses and config['name'] == 'tracked'


def test_a_tracker_whose_files_vanish_mid_run_is_reported_once_and_dropped(tmp_path, caplog):
  """The run's log (logs.MetricsLog, as train.py holds it) with MLflow's real file store, removed
  between two records: one warning, and metrics.jsonl gets every record."""
  c = _config()
  tracker = trackers.Guarded('MLflow', trackers.MlflowTracker(c, str(tmp_path), {'a': 1}))
  log = logs.MetricsLog(str(tmp_path), True, False, trackers=[tracker])
  log.write({'step': 1, 'loss': 2.0})
  shutil.rmtree(tmp_path / 'mlruns')          # what a user's cleanup does under a running job
  with caplog.at_level(logging.WARNING):
    for step in (2, 3):
      log.write({'step': step, 'loss': 1.0})
    log.close()
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and warnings[0].startswith('MLflow failed (') and 'the run goes on without it' in warnings[0]
  assert tracker.tracker is None and [r['step'] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_missing_package_is_refused_with_its_install_line(monkeypatch):
  c = _config()
  assert trackers.check(c) == []
  c.exp_manager.mlflow_logger_kwargs.update(tracking_uri='http://mlflow:5000', save_dir='/tmp/mlruns')
  assert "tracking_uri='http://mlflow:5000' and save_dir='/tmp/mlruns': the run logs to one store" in \
      '\n'.join(trackers.check(c))
  c.exp_manager.mlflow_logger_kwargs.update(tracking_uri=None, save_dir=None)
  real = trackers.importlib.util.find_spec
  monkeypatch.setattr(trackers.importlib.util, 'find_spec', lambda name: None if name == 'wandb' else real(name))
  problems = '\n'.join(validate.check(c))
  assert 'exp_manager.create_wandb_logger=True needs the wandb package, which is not installed here: pip install ' \
         'wandb, or set exp_manager.create_wandb_logger=False' in problems


def test_a_server_that_does_not_answer(tmp_path, monkeypatch):
  """W&B falls back to offline; MLflow, given its server, refuses to start the run, naming the key."""
  monkeypatch.delenv('WANDB_MODE')
  monkeypatch.setenv('WANDB_BASE_URL', 'http://127.0.0.1:9')        # the discard port: nothing listens
  assert trackers.wandb_mode(_config().exp_manager.wandb_logger_kwargs) == 'offline'
  monkeypatch.setenv('MLFLOW_HTTP_REQUEST_MAX_RETRIES', '0')
  monkeypatch.setenv('MLFLOW_HTTP_REQUEST_TIMEOUT', '5')
  c = _config(create_wandb_logger=False)
  c.exp_manager.mlflow_logger_kwargs.tracking_uri = 'http://127.0.0.1:9'
  with pytest.raises(trackers.TrackerError, match=r'exp_manager.create_mlflow_logger: mlflow could not start a run '
                                                  r'\(.*\); fix exp_manager.mlflow_logger_kwargs or set'):
    train.run(c, str(tmp_path / 'run'))
