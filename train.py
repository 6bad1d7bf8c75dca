"""flatron's one training loop.

    python train.py --config=configs/llama_tiny.py --workdir=runs/tiny
    python train.py --config=configs/llama7b.py:smoke --workdir=runs/s --config.trainer.max_steps=10

    python train.py --config=configs/nxd_yaml.py:their.yaml --dry_run          # check, print, touch nothing
    python train.py --config=configs/nxd_yaml.py:their.yaml --dry_run=trace    # ... and trace one rank's real step

Sections: setup / loop (validate, save, stop); the step itself is parallel/training.py, its
log lines logs.py, when and how a run evaluates validation.py. State the loop owns is plain
data: `params` (flat dict of tensors), the updater (optimizer, master weights, ZeRO-1 shards, the lr schedule;
optim/update.py), and `consumed_samples` (the whole data position). Every random draw is keyed,
so nothing else needs saving.
"""
import dataclasses
import os
import sys
import typing

import torch
from absl import app, flags, logging
from ml_collections import config_flags

import logs
import step_trace as traces
import user_errors
import validation

from checkpoint import session, workdir as workdirs
from configs import cli, from_files, validate as config_validation
from data import tokenizer
from data.loader import Loader
from estimates import memory, memory_check, summary as summaries
from model import flop_count, lora, objectives
from monitor import profiling, trackers
from optim import update
from parallel import comm, mesh as meshes, passes, reference as references, tensor
from parallel import compiled, device as devices, training, xla

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory: metrics.jsonl, TensorBoard, config (optional with '
                                'exp_manager.explicit_log_dir or exp_dir).')
_DEBUG = flags.DEFINE_bool('debug', False, 'Full tracebacks instead of one-line errors.')
_DRY_RUN = cli.define_dry_run('Resolve and validate the config (files, overrides), print it with the start-up summary '
                              'and memory estimate, and exit; nothing is allocated or written. --dry_run=trace also '
                              'runs the real training step of the layout\'s first and last stage on fake tensors '
                              '(step_trace.py) and reports its peak beside the estimate.')


def last_step(t, train_data):
  """The run's length: trainer.max_steps, or earlier the step completing max_epochs passes."""
  return min(t.max_steps, train_data.steps_for_epochs(t.max_epochs)) if t.max_epochs > 0 else t.max_steps


# ======================================================================================
# setup, summary
# ======================================================================================


def check_tokenizer(config):
  if config.data.tokenizer.type != 'none':
    tokenizer.check_vocab(tokenizer.load_tokenizer(config.data.tokenizer), config.model)


# ======================================================================================
# loop
# ======================================================================================


def dry_run(config, mode='estimate'):
  """--dry_run: resolve and validate as a run would, print the config and rank 0's start-up
  summary (at WORLD_SIZE processes, default one data-parallel replica), and exit. With
  mode='trace' the ranks whose programs differ then run the real step on fake tensors
  (step_trace.py); a traced peak over the named cluster's device fails it as the
  estimate's does."""
  d = config.distributed_strategy
  world_size = int(os.environ.get('WORLD_SIZE', d.tensor_model_parallel_size * d.pipeline_model_parallel_size
                                  * d.context_parallel_size))
  for note in from_files.resolve(config, world_size) + config_validation.warnings(config):
    print(note)
  text, refusal = summaries.dry_run_report(config, world_size, config_validation.check)
  print(text)
  if mode == 'trace':
    target = memory_check.target_bytes(config)
    budget = target or memory_check.available_bytes(torch.device(devices.kind(config.device)))
    text, traced_refusal = traces.report(traces.trace(config, world_size, progress=traces.print_progress),
                                         budget, another_device=target is not None)
    print(text)
    refusal = refusal or (traced_refusal if target is not None else None)
  if refusal:     # judged on the cluster trainer.plan_cluster names: the run would not fit there
    raise MemoryError(refusal)


def run(config, workdir=None):
  """Train `config` on this process's share of the mesh, in `workdir` (--workdir) or the
  exp_manager's run directory (workdirs.resolve). Returns (last logged record, params)."""
  # --- setup: everything that can be checked is checked before anything big is allocated
  world_size = int(os.environ.get('WORLD_SIZE', '1'))
  for note in from_files.resolve(config, world_size):
    logging.info('%s', note)
  workdir = workdirs.resolve(config, workdir)
  for warning in config_validation.warnings(config):
    logging.warning('config: %s', warning)
  for key, value, effect in xla.configure(config, devices.kind(config.device)):   # before the XLA runtime starts
    logging.info('%s=%s: %s', key, value, effect)
  host_malloc = devices.configure_host_malloc(config)     # before anything big is allocated
  mesh = meshes.init(config)
  before = memory_check.measured_peak_bytes(mesh.device)   # the process before the run: not in the estimate
  lead = mesh.rank == 0                    # the one rank that writes files (and prints, by default)
  logs.configure_logging(mesh.rank, int(os.environ.get('LOCAL_RANK', '0')),
                             config.exp_manager.log_local_rank_0_only)
  lock = comm.on_every_rank(lambda: workdirs.Lock(workdir) if lead else None, mesh.host_group,
                            'locking the workdir')
  log, checkpoints = None, None
  try:
    sizes = training.local_sizes(config, mesh)
    est = memory.estimate(config, sizes, mesh.dp, mesh.pp_rank)     # this stage: 1F1B keeps pp - pp_rank in flight
    est, heap = memory_check.heap_trim(config, mesh, est, before)   # where memory is short, trimmed near it
    logging.info('\n%s', summaries.startup(config, mesh, sizes, est))
    comm.on_every_rank(lambda: memory_check.check_fits(config, mesh, est, config_validation.check), mesh.host_group,
                       'the memory check')
    comm.on_every_rank(lambda: check_tokenizer(config), mesh.host_group, 'loading the tokenizer')
    ops = tensor.config_ops(config, mesh)
    peak = devices.peak_flops(mesh.device)
    logging.info('MFU peak: %.3e FLOP/s per process (%s)', *peak)
    if host_malloc:
      logging.info('host malloc: %s (keep_freed_host_memory)%s', host_malloc, f'; kept heap: {heap}' if heap else '')

    # --- data: each DP rank reads its slice of every global batch
    # (an empty test split fails here, naming data.splits_string or data.test_dir)
    splits = (('train',) + (('valid',) if validation.validates(config) else ())
              + (('test',) if config.trainer.limit_test_batches else ()))
    data = {split: Loader(config, split, mesh.dp_rank, mesh.dp) for split in splits}
    for loader in data.values():
      if loader.sft:
        logging.info('%s', loader.source.summary())

    # --- init, then restore (or init_from): parameters, optimizer state and data position
    params = training.init_params(config, mesh)
    updater = update.Updater(params, config, mesh, training.placement(config, mesh),
                             trainable=lora.trainable(config.model, params))
    checkpoints = session.Session(config, workdir, mesh, updater)
    start_step, consumed_samples = checkpoints.restore_or_init()
    reference = None                       # the reference model's params, for objectives that need one (DPO)
    if objectives.for_config(config).reference is not None:
      reference = references.params(params, references.setup(
          config, mesh, ops, params, tuple(data.values()),
          lambda: checkpoints.load_init_weights(training.init_params(config, mesh)),
          lambda: checkpoints.starting_adapters(training.init_params(config, mesh, set(updater.trainable)))))
    if lead:
      workdirs.write_config(workdir, config)
    log = logs.MetricsLog(workdir, lead, config.exp_manager.create_tensorboard_logger,
                          resumed_at=start_step if start_step > 0 else None, name=config.name,
                          trackers=trackers.start(config, workdir, start_step > 0) if lead else ())
    record = _loop(Run(config, workdir, mesh, ops, peak, params, updater, checkpoints, log, data, reference),
                   start_step, consumed_samples)
    logging.info('%s', memory_check.peak_report(mesh, est['total'], before))   # every rank's peak against its estimate
    return record, params
  finally:
    if checkpoints is not None:
      checkpoints.close()
    if log is not None:
      log.close()
    if lock is not None:
      lock.release(unused=log is None)      # failed before the run started: leave no empty workdir


@dataclasses.dataclass(frozen=True)
class Run:
  """What `run` sets up, handed to the loop and to its evaluations (validation.py) as one."""
  config: typing.Any
  workdir: str
  mesh: meshes.Mesh
  ops: typing.Any           # the model's Ops on this mesh (parallel/tensor.py)
  peak: tuple               # (peak FLOP/s per process, where the figure comes from): MFU
  params: dict
  updater: update.Updater
  checkpoints: session.Session
  log: logs.MetricsLog
  data: dict                # split -> Loader
  reference: typing.Optional[dict]     # the reference model's params (DPO without precomputed log-probs)


def _loop(r: Run, start_step, consumed_samples):
  config, t, train_data, updater, checkpoints = r.config, r.config.trainer, r.data['train'], r.updater, r.checkpoints
  if t.num_sanity_val_steps:
    sanity, sanity_metrics = passes.evaluate(r.params, r.data['valid'], config, r.mesh, r.ops, t.num_sanity_val_steps,
                                             r.reference)
    logging.info('sanity validation: val_loss %.4f', sanity)
    if start_step == 0:                     # the model before training, e.g. a fine-tune's base
      r.log.write({'step': 0, 'sanity_val_loss': sanity, 'consumed_samples': consumed_samples,
                   **{f'sanity_val_{k}': v for k, v in sanity_metrics.items()}})
  flops_per_token = flop_count.flops_per_token(config.model, config.data.seq_length)
  total = last_step(t, train_data)
  reporter = logs.StepReporter(config, r.mesh, r.log, r.peak, total, start_step, flops_per_token)
  val = None
  window = profiling.Window(config, r.workdir, r.mesh.rank, r.mesh.device)
  for step in range(start_step, total):
    window.before(step + 1)
    last = step + 1 == total
    logged = logs.every(step + 1, t.log_every_n_steps) or last
    # ZeRO-1's parameter gathers stay in flight into the next step's forward (overlap_param_gather);
    # the parameter norm comes from the rows each rank owns: no wait for them
    out = training.train_step(r.params, updater, train_data.global_batch(consumed_samples), config, step, r.mesh,
                              r.ops, r.reference, defer_param_gather=True,
                              param_norm=config.exp_manager.log_parameter_norm and logged,
                              layer_stats=config.exp_manager.log_layer_stats and logged)
    devices.step_boundary(r.mesh.device)  # XLA: the step is one graph, compiled once
    window.after(step + 1)
    if step == start_step:
      _first_step_report(config, updater)
    before, consumed_samples = consumed_samples, consumed_samples + config.data.global_batch_size
    reporter.add(step, out, consumed_samples)    # reads the step before this one
    stopped = None if last else checkpoints.stop_reason(step + 1)
    saving = checkpoints.due(step + 1, last, stopped is not None)
    validating = validation.due(t, train_data, step + 1, last, before, consumed_samples) or (
        saving and checkpoints.needs_metrics)
    if last or saving or stopped or validating:
      updater.wait_params()                 # the one place the loop reads the parameters outside a step
    val = None                              # a validation metric as monitor: every save is validated
    if validating:
      reporter.flush()
      val = validation.evaluate_and_log(r, 'val', t.limit_val_batches, step + 1, consumed_samples)
      reporter.restart_window()
    if saving or stopped:
      reporter.flush()                      # the log is whole up to a committed step
    checkpoints.maybe_save(step + 1, consumed_samples, last=last, stopping=stopped is not None, metrics=val)
    if stopped:
      window.close()                        # stopped inside the window: what it recorded
      checkpoints.close()                   # the save is committed before we say so
      logging.warning('stopped at step %d by %s; resume with --config.exp_manager.resume_if_exists=True',
                      step + 1, stopped)
      return {**reporter.flush(), **(val or {})}
  window.close()                            # a window past the last step: what it recorded
  record = {**reporter.flush(), **(val or {})}
  if t.limit_test_batches:                  # after training, not after a stop
    record.update(validation.evaluate_and_log(r, 'test', t.limit_test_batches, max(total, start_step),
                                              consumed_samples))
  logging.info('done: %d steps | %s', total, r.log.destinations())
  return record


def _first_step_report(config, updater):
  logging.info('optimizer state + master weights on rank 0 (measured): %s', memory.human_bytes(updater.state_bytes()))
  if config.model.compile:
    stats = compiled.stats()
    logging.info('model.compile: the first step compiled %d graph(s) (%d graph break(s)) in %.1f s; the first '
                 'logged step time includes it', stats['graphs'], stats['graph_breaks'], stats['compile_s'])


def _run_flags():
  config = _CONFIG.value
  cli.command_line_wins(config, config_flags.get_override_values(flags.FLAGS['config']))
  if _DRY_RUN.value:
    dry_run(config, _DRY_RUN.value)
  else:
    run(config, _WORKDIR.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  try:     # a user's error: one line, exit 2 (user_errors.py; --debug for the traceback)
    user_errors.exit_on_error(_run_flags, debug=_DEBUG.value)
  except KeyboardInterrupt:
    print('interrupted: exited at once, nothing saved after the last checkpoint', file=sys.stderr)
    sys.exit(130)
  finally:
    meshes.shutdown()


def parse_flags(argv):
  """absl's flag parsing, with a bad --config file, preset or key reported in one line."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # loaded lazily: a missing config file fails here
    return rest
  except Exception as e:  # pylint: disable=broad-except
    if '--debug' in argv or user_errors.debugging():
      raise
    print(f'error: {cli.explain(argv, e)}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main, flags_parser=parse_flags)
