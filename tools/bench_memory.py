"""Memory per rank, measured against estimates/memory.py's estimate, phase by phase.

    python -m tools.bench_memory --quick          # llama_tiny, every layout, fp32 (< 2 minutes)
    python -m tools.bench_memory                  # llama_tiny, llama_50m, 207m x layouts x recipes
    python -m tools.bench_memory --models=207m --layouts=dp2,dp2_zero1 --recipes=fp32
    python -m tools.bench_memory --models=mixtral_tiny --layouts=1proc,tp2,pp2 --recipes=fp32

Each row runs in fresh processes (2 for the 2-rank layouts: gloo, 1 thread each) that train
`--steps` steps of seq 128 on the synthetic stream and then save a checkpoint, through the
same functions as train.py. Phases: init (parameters, updater), forward_backward,
grad_reduction (updater.gradients: waiting on the DP reductions the backward started; then
the TP/PP sums), update (updater.step: clip, the optimizer, rounding, ZeRO-1's gather) and
checkpoint_save. The measured figure is above the process's baseline, its RSS after imports,
the data and the process groups but before any model tensor exists (printed):
  CPU   peak = ru_maxrss at the end - baseline (exact); the phase printed is the one during
        which ru_maxrss last grew; per-phase peaks come from a thread sampling
        /proc/self/statm every 0.2 ms (a peak shorter than that can be missed there, never
        in the overall figure). RSS is what the OS counts against the job, including what
        glibc keeps of freed memory; see docs/memory-and-precision.md.
  CUDA  torch.cuda.max_memory_allocated, reset at every phase, above memory_allocated at the
        baseline.
The estimate column is memory.estimate's peak phase; `err` is (estimate - measured) / measured.
"""
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags
import torch

import tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY = 'distributed_strategy.'
SHAPE_207M = {'model.num_layers': 12, 'model.hidden_size': 1024, 'model.ffn_hidden_size': 2816,
              'model.num_attention_heads': 16, 'model.num_kv_heads': 8}
# model -> (config file, keys set over it). seq 128 everywhere; micro batch 2 x 4 per step.
MODELS = {
    'llama_tiny': ('configs/llama_tiny.py', {}),
    'llama_50m': ('configs/llama_50m.py', {}),
    '207m': ('configs/llama_50m.py', SHAPE_207M),
    'mixtral_tiny': ('configs/mixtral_tiny.py', {}),     # MoE: 8 experts, each split over TP at tp2
}
BATCH = {'data.seq_length': 128, 'data.micro_batch_size': 2, 'data.global_batch_size': 8}
LAYOUTS = {
    '1proc': (1, {}),
    'dp2': (2, {}),
    'dp2_zero1': (2, {STRATEGY + 'zero1': True}),
    'tp2': (2, {STRATEGY + 'tensor_model_parallel_size': 2}),
    'pp2': (2, {STRATEGY + 'pipeline_model_parallel_size': 2}),
}
RECIPES = ('fp32', 'bf16SR', 'mixed_precision')
# glibc serves blocks under its mmap threshold from arenas it keeps after free; by default the
# threshold grows with freed blocks up to 32 MiB, so RSS holds freed activations and gradients
# (+10-25% at llama_50m). Fixed at 64 KiB (which also stops it growing), RSS follows live
# tensors; --malloc_default measures glibc as it comes.
MMAP_THRESHOLD = 64 * 1024
VERBOSE = os.environ.get('BENCH_MEMORY_VERBOSE') == '1'
PHASES = ('init', 'forward_backward', 'grad_reduction', 'update', 'checkpoint_save')


# --- the worker: one rank of one row ---------------------------------------------------

PAGE = os.sysconf('SC_PAGE_SIZE')


def rss_bytes(anon=False):
  """Resident bytes of this process; `anon`: less file-backed pages (code, mapped files)."""
  with open('/proc/self/statm') as f:
    fields = f.read().split()
  return (int(fields[1]) - (int(fields[2]) if anon else 0)) * PAGE


def max_rss_bytes():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhaseMeter:
  """Peak memory per phase above a baseline. `phase(name)` starts a phase; `close()` ends it."""

  def __init__(self, device, interval=2e-4):
    self.torch, self.cuda = torch, device.type == 'cuda'
    self.peaks, self.anon, self.current, self.peak_phase = {}, {}, None, None
    if self.cuda:
      torch.cuda.synchronize()
      self.baseline = torch.cuda.memory_allocated()
    else:
      self.baseline, self.anon_baseline = rss_bytes(), rss_bytes(anon=True)
      self.max_rss = max_rss_bytes()
      self._stop = threading.Event()
      self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
      self._thread.start()

  def _sample(self, interval):
    while not self._stop.is_set():
      phase, rss, anon = self.current, rss_bytes(), rss_bytes(anon=True)
      if phase is not None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
        self.anon[phase] = max(self.anon.get(phase, 0), anon)
      time.sleep(interval)

  def _end(self):
    if self.current is None:
      return
    if self.cuda:
      self.torch.cuda.synchronize()
      peak = self.torch.cuda.max_memory_allocated()
      self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
      if self.peak_phase is None or peak > self.peaks[self.peak_phase]:
        self.peak_phase = self.current
    else:
      now = max_rss_bytes()
      self.peaks[self.current] = max(self.peaks.get(self.current, 0), rss_bytes(),
                                     now if now > self.max_rss else 0)
      if now > self.max_rss:               # the process's peak grew in this phase
        self.max_rss, self.peak_phase = now, self.current

  def phase(self, name):
    self._end()
    self.current = name
    if self.cuda:
      self.torch.cuda.reset_peak_memory_stats()

  def close(self):
    self._end()
    self.current = None
    if not self.cuda:
      self._stop.set()
      self._thread.join()
    peak = (max(self.peaks.values()) if self.cuda else self.max_rss) - self.baseline
    return {'baseline': self.baseline, 'peak': peak, 'peak_phase': self.peak_phase,
            'phases': {p: v - self.baseline for p, v in self.peaks.items()},
            'anon_phases': {p: v - self.anon_baseline for p, v in self.anon.items()} if not self.cuda else {}}


def _config(row):
  import importlib  # pylint: disable=import-outside-toplevel
  path, keys = MODELS[row['model']]
  config = importlib.import_module(path[:-3].replace('/', '.')).get_config()
  keys = {**keys, **BATCH, **LAYOUTS[row['layout']][1], 'precision.type': row['recipe'],
          'exp_manager.create_checkpoint_callback': True}
  for key, value in keys.items():
    *parents, leaf = key.split('.')
    section = config
    for p in parents:
      section = section[p]
    section[leaf] = value
  return config


def worker(row, out_path):
  """One rank of `row` ({'model', 'layout', 'recipe', 'steps'}): trains, saves, writes JSON."""
  from checkpoint import session  # pylint: disable=import-outside-toplevel
  from configs import validate  # pylint: disable=import-outside-toplevel
  from data.loader import Loader  # pylint: disable=import-outside-toplevel
  from optim import update  # pylint: disable=import-outside-toplevel
  from estimates import memory  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes, passes, tensor, training
  torch.set_num_threads(1)
  config = _config(row)
  validate.validate(config, int(os.environ.get('WORLD_SIZE', '1')))
  mesh = meshes.init(config)
  try:
    ops = tensor.config_ops(config, mesh)
    loader = Loader(config, 'train', mesh.dp_rank, mesh.dp)
    batches = [loader.global_batch(i * config.data.global_batch_size) for i in range(row['steps'])]
    sizes = training.local_sizes(config, mesh)
    est = memory.estimate(config, sizes, mesh.dp, mesh.pp_rank)
    # Beside the JSON, inside run_row's temporary directory: removed with it, even on failure.
    workdir = os.path.join(os.path.dirname(out_path), 'workdir')
    meter = PhaseMeter(mesh.device)
    meter.phase('init')
    params = training.init_params(config, mesh)
    updater = update.Updater(params, config, mesh, training.placement(config, mesh))
    checkpoints = session.Session(config, workdir, mesh, updater)
    _instrument(meter, passes, updater)
    for step, micro_batches in enumerate(batches):
      meter.phase('forward_backward')
      training.train_step(params, updater, micro_batches, config, step, mesh, ops)
    meter.phase('checkpoint_save')
    checkpoints.maybe_save(len(batches), len(batches) * config.data.global_batch_size, last=True)
    checkpoints.close()
    result = meter.close()
    result.update(rank=mesh.rank, estimate=est,
                  params=sum(sizes.values()))
    with open(out_path, 'w') as f:
      json.dump(result, f)
  finally:
    meshes.shutdown()


def _instrument(meter, passes, updater):
  """Phase labels around the step's parts, without changing what train_step runs."""
  def around(phase, fn):
    def wrapped(*args, **kwargs):
      meter.phase(phase)
      return fn(*args, **kwargs)
    return wrapped
  passes.forward_backward = around('forward_backward', passes.forward_backward)
  updater.gradients = around('grad_reduction', updater.gradients)
  updater.step = around('update', updater.step)


# --- the driver --------------------------------------------------------------------------

def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_row(row, timeout, malloc_default=False):
  """[result per rank] of `row`, each rank in its own fresh process (killed on failure)."""
  world = LAYOUTS[row['layout']][0]
  port = _free_port()
  with tempfile.TemporaryDirectory() as tmp:
    procs, outs = [], [os.path.join(tmp, f'{r}.json') for r in range(world)]
    try:
      for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS='1', RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR='127.0.0.1',
                   MASTER_PORT=str(port))
        if not malloc_default:
          env['MALLOC_MMAP_THRESHOLD_'] = str(MMAP_THRESHOLD)
        code = f'from tools import bench_memory; bench_memory.worker({row!r}, {outs[rank]!r})'
        procs.append(subprocess.Popen([sys.executable, '-c', code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
      deadline = time.time() + timeout
      logs = [p.communicate(timeout=max(1, deadline - time.time()))[0] for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
    for p, log in zip(procs, logs):
      if p.returncode:
        raise RuntimeError(f'{row} failed ({p.returncode}):\n{log[-3000:]}')
    results = []
    for out in outs:
      with open(out) as f:
        results.append(json.load(f))
    return results


def mib(n):
  return f'{n / 2**20:,.1f}'


def report(row, results):
  """Table lines of one row: estimate, measured peak and phase per rank."""
  lines = []
  for r in results:
    est = r['estimate']
    phases = est.get('phases', {})
    err = (est['total'] - r['peak']) / max(r['peak'], 1)
    lines.append(f"| {row['model']} | {row['layout']} | {row['recipe']} | {r['rank']} | {r['params'] / 1e6:.1f}M | "
                 f"{mib(r['baseline'])} | {mib(est['total'])} ({est.get('peak_phase', '?')}) | "
                 f"{mib(r['peak'])} ({r['peak_phase']}) | {err:+.1%} | "
                 + ' / '.join(f"{mib(r['phases'].get(p, 0))}~{mib(phases.get(p, 0))}" for p in PHASES) + ' |'
                 + (' anon ' + ' / '.join(mib(r['anon_phases'].get(p, 0)) for p in PHASES) if VERBOSE else ''))
  return lines


def components(results):
  est = results[0]['estimate']
  return ', '.join(f'{k} {mib(v)}' for k, v in est.items() if isinstance(v, (int, float)) and k != 'total')


def define_flags():
  tools.define_list_of('models', list(MODELS), MODELS, 'Models')
  tools.define_list_of('layouts', list(LAYOUTS), LAYOUTS, 'Layouts')
  tools.define_list_of('recipes', list(RECIPES), RECIPES, 'Precision recipes')
  flags.DEFINE_integer('steps', 2, 'Training steps before the checkpoint save (the optimizer state exists '
                       'from the first).')
  flags.DEFINE_bool('malloc_default', False, 'Leave glibc\'s mmap threshold dynamic (as a plain run does): RSS '
                    'then also holds freed blocks glibc keeps.')
  flags.DEFINE_bool('quick', False, 'llama_tiny, fp32, every layout: under 2 minutes.')
  flags.DEFINE_integer('timeout', 1200, 'Seconds a row may take before its processes are killed.')


def main(argv):
  tools.no_arguments(argv)
  tools.exit_on_sigterm()
  f = flags.FLAGS
  models, recipes = (['llama_tiny'], ['fp32']) if f.quick else (f.models, f.recipes)
  print('MiB above each rank\'s baseline (RSS before any model tensor); estimate = memory.estimate\'s peak phase; '
        'phases: measured~estimate for ' + ' / '.join(PHASES))
  print('| model | layout | recipe | rank | params/rank | baseline | estimate (phase) | measured (phase) | err '
        '| phases |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  notes = []
  for model in models:
    for layout in f.layouts:
      for recipe in recipes:
        row = {'model': model, 'layout': layout, 'recipe': recipe, 'steps': f.steps}
        try:
          results = run_row(row, f.timeout, f.malloc_default)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
          print(f'| {model} | {layout} | {recipe} | failed: {str(e).splitlines()[0][:200]} |', flush=True)
          continue
        print('\n'.join(report(row, results)), flush=True)
        notes.append(f'{model} {layout} {recipe} rank 0 estimate: {components(results)}')
  print('\n'.join(notes))


if __name__ == '__main__':
  define_flags()
  app.run(main)
