"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow, from
NxD Training's (NeMo's) exp_manager keys: create_wandb_logger / wandb_logger_kwargs and
create_mlflow_logger / mlflow_logger_kwargs. Each gets every record metrics.jsonl gets (training
steps, validation, test), at its step, and the run's config once, from the lead rank.

W&B runs offline (files under <save_dir or workdir>/wandb, `wandb sync` uploads them later) when
wandb_logger_kwargs.offline is set, WANDB_MODE says so, or its server is not reachable. MLflow
writes to tracking_uri (or MLFLOW_TRACKING_URI), else to a local file store,
<save_dir or workdir>/mlruns (MLflow 3 keeps that store in maintenance mode: this process sets
MLFLOW_ALLOW_FILE_STORE=true for it; reading it back needs the same). A resumed run continues
the tracker runs it started (their ids kept in <workdir>/trackers.json).

Both packages are optional: a config that asks for one that is not installed is refused at
start-up with the install line. A tracker that fails during the run (its files removed, its
server gone) is reported once and dropped; the run goes on (`Guarded`).
"""
import importlib.util
import json
import os
import socket
import time
import urllib.parse

from absl import logging

import user_errors

PACKAGES = {'create_wandb_logger': ('wandb', 'pip install wandb'),
            'create_mlflow_logger': ('mlflow', 'pip install mlflow (or mlflow-skinny)')}
IDS_FILE = 'trackers.json'
WANDB_HOST = 'https://api.wandb.ai'


class TrackerError(user_errors.UserError):
  """A tracker the config asks for could not start its run."""


def check(config) -> list:
  """Trackers asked for whose package is missing, and MLflow given two stores."""
  e, problems = config.exp_manager, []
  kw = e.mlflow_logger_kwargs
  if e.create_mlflow_logger and kw.tracking_uri and kw.save_dir:
    problems.append(f'exp_manager.mlflow_logger_kwargs.tracking_uri={kw.tracking_uri!r} and save_dir={kw.save_dir!r}: '
                    'the run logs to one store; keep tracking_uri (a server or database) or save_dir (a file store)')
  for key, (module, install) in PACKAGES.items():
    if e.get(key) and importlib.util.find_spec(module) is None:
      problems.append(f'exp_manager.{key}=True needs the {module} package, which is not installed here: {install}, '
                      f'or set exp_manager.{key}=False')
  return problems


def flat(tree, prefix=''):
  """A nested config as {'a.b.c': value} (what both trackers show as the run's parameters)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flat(value, f'{prefix}{key}.'))
    else:
      out[prefix + key] = value
  return out


def _numbers(record):
  """The record's numeric values but its step (None: non-finite, as metrics.jsonl writes them)."""
  return {k: float(v) for k, v in record.items()
          if k != 'step' and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Guarded:
  """A tracker whose first error is reported once, naming it, after which it is dropped: nothing
  in the run depends on a tracker, so its failure does not stop training."""

  def __init__(self, name, tracker):
    self.name, self.tracker = name, tracker

  def log(self, record):
    self._call('log', record)

  def close(self):
    self._call('close')
    self.tracker = None

  def _call(self, method, *args):
    if self.tracker is None:
      return
    try:
      getattr(self.tracker, method)(*args)
    except Exception as e:  # pylint: disable=broad-except    # whatever the library raises
      first = str(e).strip().splitlines()
      logging.warning('%s failed (%s%s); the run goes on without it', self.name, type(e).__name__,
                      f': {first[0]}' if first else '')
      self.tracker = None


def start(config, workdir, resumed):
  """The trackers the config asks for (lead rank only), each Guarded; `resumed`: continue their runs."""
  ids_path = os.path.join(workdir, IDS_FILE)
  ids = {}
  if resumed and os.path.exists(ids_path):
    with open(ids_path) as f:
      ids = json.load(f)
  params = flat(config.to_dict())
  out = []
  kinds = (('create_wandb_logger', 'wandb', WandbTracker), ('create_mlflow_logger', 'mlflow', MlflowTracker))
  for key, name, make in kinds:
    if not config.exp_manager[key]:
      continue
    try:
      tracker = make(config, workdir, params, ids.get(name))
    except Exception as e:  # pylint: disable=broad-except    # whatever the library raises, at start-up
      for started in out:
        started.close()
      raise TrackerError(f'exp_manager.{key}: {name} could not start a run ({type(e).__name__}: '
                         f'{str(e).strip().splitlines()[0] if str(e).strip() else ""}); fix exp_manager.'
                         f'{name}_logger_kwargs or set {key}=False') from e
    ids[name] = tracker.run_id
    out.append(Guarded(f'{"W&B" if name == "wandb" else "MLflow"} ({tracker.where})', tracker))
  if out:
    with open(ids_path, 'w') as f:
      json.dump(ids, f)
  return out


def _reachable(url, timeout_s=3.0) -> bool:
  parsed = urllib.parse.urlparse(url)
  try:
    with socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == 'https' else 80)),
                                  timeout=timeout_s):
      return True
  except OSError:
    return False


def wandb_mode(kwargs):
  """'offline' when asked (offline=True, or WANDB_MODE) or when the server does not answer, else 'online'."""
  if kwargs.offline or os.environ.get('WANDB_MODE') in ('offline', 'dryrun'):
    return 'offline'
  if os.environ.get('WANDB_MODE') == 'disabled':
    return 'disabled'
  if kwargs.offline is None and not _reachable(os.environ.get('WANDB_BASE_URL', WANDB_HOST)):
    logging.info('W&B: %s does not answer; logging offline (upload later with `wandb sync`)',
                 os.environ.get('WANDB_BASE_URL', WANDB_HOST))
    return 'offline'
  return 'online'


class WandbTracker:
  """A W&B run: the config as its config, each record's numbers at its step."""

  def __init__(self, config, workdir, params, run_id=None):
    import wandb  # pylint: disable=import-outside-toplevel
    kw = config.exp_manager.wandb_logger_kwargs
    save_dir = kw.save_dir or workdir
    os.makedirs(save_dir, exist_ok=True)
    mode = wandb_mode(kw)
    run_id = kw.id or run_id
    self.run = wandb.init(project=kw.project or config.name, name=kw.name or config.name, entity=kw.entity,
                          settings=wandb.Settings(quiet=True),
                          group=kw.group, tags=list(kw.tags) if kw.tags else None, notes=kw.notes,
                          job_type=kw.job_type, dir=save_dir, mode=mode, id=run_id,
                          resume='allow' if run_id else None, config=params)
    self.run_id, self.where = self.run.id, f'{mode}, {save_dir}/wandb'

  def log(self, record):
    values = _numbers(record)
    if values:
      self.run.log(values, step=int(record['step']))

  def close(self):
    self.run.finish()


class MlflowTracker:
  """An MLflow run in experiment `experiment_name` (default: the run's name): the flattened config
  as its parameters, each record's numbers as metrics at its step."""

  def __init__(self, config, workdir, params, run_id=None):
    kw = config.exp_manager.mlflow_logger_kwargs
    self.uri = self.where = kw.tracking_uri or os.environ.get('MLFLOW_TRACKING_URI') or \
        'file:' + os.path.abspath(kw.save_dir or os.path.join(workdir, 'mlruns'))
    if self.uri.startswith('file:') or '://' not in self.uri:
      os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')     # MLflow 3's file store, opted into
    from mlflow import entities  # pylint: disable=import-outside-toplevel
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
    self.client, self.entities = MlflowClient(tracking_uri=self.uri), entities
    name = kw.experiment_name or config.name
    experiment = self.client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else \
        self.client.create_experiment(name, artifact_location=kw.artifact_location)
    self.run_id = kw.run_id or run_id
    if self.run_id:
      self.client.update_run(self.run_id, status='RUNNING')
    else:
      run = self.client.create_run(experiment_id, run_name=kw.run_name or config.name,
                                   tags={str(k): str(v) for k, v in (kw.tags or {}).items()})
      self.run_id = run.info.run_id
      items = [entities.Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
      for i in range(0, len(items), 100):      # MLflow takes at most 100 parameters a batch
        self.client.log_batch(self.run_id, params=items[i:i + 100])

  def log(self, record):
    stamp, step = int(time.time() * 1000), int(record['step'])
    metrics = [self.entities.Metric(k, v, stamp, step) for k, v in _numbers(record).items()]
    for i in range(0, len(metrics), 1000):      # and 1000 metrics
      self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

  def close(self):
    self.client.set_terminated(self.run_id)
