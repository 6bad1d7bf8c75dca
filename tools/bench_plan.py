"""The planner against this machine: tools/bench_layouts.py's layouts measured, beside the
step-time model's prediction for each on the `local` cluster (run `python -m tools.plan
--calibrate` first; docs/planning.md has the table).

    python -m tools.bench_plan                               # dp2, dp2_zero1, tp2, tp2_sp, pp2
    python -m tools.bench_plan --layouts=dp2,pp2 --steps=3 --shape=small
    python -m tools.bench_plan --nomeasure                   # predictions only

Each layout runs as bench_layouts runs it (torchrun, 2 processes x 1 thread, its processes
killed on failure or timeout); the prediction is for the same config at 2 devices, from the
figures --calibrate measures, measured again just before and just after the layout runs
(--recalibrate, the default): the prediction is the mean of the two (harmonic, in tokens/s),
and both are printed, so the machine's drift during the run shows.
"""
import ast
import dataclasses
import os

from absl import app, flags

from configs import cli
from estimates import clusters, step_time
import tools
from tools import bench_layouts, plan_calibrate

FLAGS = flags.FLAGS


def _set(config, assignment):
  """Apply one `--config.a.b=value` flag to `config` (the value typed as the key's current one)."""
  path, value = assignment[len('--config.'):].split('=', 1)
  *parents, leaf = path.split('.')
  node = config
  for key in parents:
    node = node[key]
  current = node[leaf]
  if isinstance(current, bool):
    node[leaf] = value in ('True', 'true', '1')
  elif isinstance(current, (int, float)):
    node[leaf] = type(current)(ast.literal_eval(value))
  else:
    node[leaf] = value


def layout_config(config_path, shape, layout):
  """The config tools/bench.py runs for `layout` at `shape` (bench_layouts' flags)."""
  config = cli.load(config_path)
  for flag in bench_layouts.SHAPES[shape][0] + bench_layouts.LAYOUTS[layout]:
    _set(config, flag)
  config.device = 'cpu'
  return config


def predictions(config_path, shape, layouts, cluster):
  return {name: step_time.predict(layout_config(config_path, shape, name), cluster, bench_layouts.processes(name))
          for name in layouts}


def define_flags():
  flags.DEFINE_string('config', 'configs/llama_tiny.py', 'Config file (bench_layouts resizes it).')
  flags.DEFINE_enum('shape', 'small', list(bench_layouts.SHAPES), 'bench_layouts\' shape.')
  tools.define_list_of('layouts', ['dp2', 'dp2_zero1', 'tp2', 'tp2_sp', 'pp2'], bench_layouts.LAYOUTS, 'Layouts')
  flags.DEFINE_integer('steps', 5, 'Timed steps.')
  flags.DEFINE_integer('warmup', 2, 'Untimed warm-up steps.')
  flags.DEFINE_integer('timeout', 900, 'Seconds each bench may take.')
  flags.DEFINE_bool('measure', True, 'Run the layouts (else print the predictions only).')
  flags.DEFINE_bool('recalibrate', True, 'Calibrate again just before each layout runs (a shared '
                    'machine\'s load moves the figures); else the last --calibrate\'s.')


def main(argv):
  tools.no_arguments(argv)
  cluster = clusters.get('local')
  print(f'cluster local: {cluster.source}')
  predicted = predictions(FLAGS.config, FLAGS.shape, FLAGS.layouts, cluster)
  print('| layout (2 processes x 1 thread) | predicted tokens/s | measured tokens/s | predicted / measured | '
        'predicted terms (s/step) |')
  print('|---|---|---|---|---|')
  bench_flags = [f'--config={FLAGS.config}', f'--steps={FLAGS.steps}', f'--warmup={FLAGS.warmup}']
  bench_flags += bench_layouts.SHAPES[FLAGS.shape][0]
  for name, p in predicted.items():
    config, measured, spread = layout_config(FLAGS.config, FLAGS.shape, name), None, ''
    if FLAGS.measure:
      before = plan_calibrate.calibrated()[0] if FLAGS.recalibrate else cluster
      cmd = [bench_layouts.sys.executable, '-m', 'torch.distributed.run', '--standalone',
             f'--nproc_per_node={bench_layouts.processes(name)}',
             '-m', 'tools.bench'] + bench_flags + bench_layouts.LAYOUTS[name]
      measured = bench_layouts._run(cmd, dict(os.environ, OMP_NUM_THREADS='1'), FLAGS.timeout)[0]  # pylint: disable=protected-access
      if FLAGS.recalibrate:    # the machine before and after the layout ran: their mean, and how far apart
        after = plan_calibrate.calibrated()[0]
        pair = [step_time.predict(config, c, bench_layouts.processes(name)) for c in (before, after)]
        p = min(pair, key=lambda q: q.step_s)
        p = dataclasses.replace(p, step_s=sum(q.step_s for q in pair) / 2,
                                tokens_per_s=2 / sum(1 / q.tokens_per_s for q in pair))
        spread = f' ({pair[0].tokens_per_s:,.0f} before, {pair[1].tokens_per_s:,.0f} after'
        if config.distributed_strategy.tensor_model_parallel_size > 1:    # the fit that TP rows rest on
          spread += f'; sync_wait {before.sync_wait * 1e3:.2f} / {after.sync_wait * 1e3:.2f} ms'
        spread += ')'
    terms = ', '.join(f'{k} {v:.3g}' for k, v in p.terms.items() if v)
    ratio = f'{p.tokens_per_s / measured:.2f}' if measured else ''
    print(f'| {name} | {p.tokens_per_s:,.0f}{spread} | {f"{measured:,.0f}" if measured else ""} | {ratio} | {terms} |',
          flush=True)


if __name__ == '__main__':
  define_flags()
  app.run(main)
