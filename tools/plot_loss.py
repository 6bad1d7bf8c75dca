"""Training loss of several runs as one SVG picture (no plotting library: the docs' figures).

    python -m tools.plot_loss --runs=runs/a,runs/b --labels=bf16,fp8 --out=docs/loss.svg
    python -m tools.plot_loss --runs=runs/a --metrics=grad_norm/layers.0,grad_norm/layers.7 --out=grads.svg

Each run's `metrics.jsonl` gives one line per metric (`--metrics`, default the loss: its records
holding it), smoothed over `--window` steps; the legend says each line's mean over the last
`--window` steps.
"""
import json
import os
from xml.sax import saxutils

from absl import app, flags

import tools

COLORS = ('#1f77b4', '#d62728', '#2ca02c', '#9467bd')
W, H, PAD = 640, 360, 56


def losses(run, metric='loss') -> list:
  """[(step, value)] of `metric` in a run directory's metrics.jsonl (the last record of a step wins)."""
  path = os.path.join(run, 'metrics.jsonl')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file; --runs takes run directories (a workdir)')
  by_step = {}
  with open(path, encoding='utf-8') as f:
    for line in f:
      record = json.loads(line)
      if record.get(metric) is not None:
        by_step[record['step']] = record[metric]
  if not by_step:
    raise ValueError(f'{path}: no record holds {metric!r}')
  return sorted(by_step.items())


def smooth(points, window):
  out = []
  for i, (step, _) in enumerate(points):
    part = [v for _, v in points[max(0, i - window + 1):i + 1]]
    out.append((step, sum(part) / len(part)))
  return out


def svg(series, title, window=10, quantity='loss') -> str:
  """`series`: [(label, [(step, value)])] as an SVG line chart of `quantity`."""
  curves = [(label, smooth(points, window)) for label, points in series]
  xs = [s for _, pts in curves for s, _ in pts]
  ys = [v for _, pts in curves for _, v in pts]
  x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)

  def sx(s):
    return PAD + (s - x0) / max(x1 - x0, 1) * (W - 2 * PAD)

  def sy(v):
    return H - PAD - (v - y0) / max(y1 - y0, 1e-9) * (H - 2 * PAD)

  parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           'font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle">{saxutils.escape(title)}</text>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 16}" text-anchor="middle">step</text>',
           f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">'
           f'{saxutils.escape(quantity)} ({window}-step mean)</text>']
  for k in range(5):
    v, s = y0 + (y1 - y0) * k / 4, x0 + (x1 - x0) * k / 4
    parts.append(f'<text x="{PAD - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    parts.append(f'<text x="{sx(s):.1f}" y="{H - PAD + 16}" text-anchor="middle">{s:.0f}</text>')
  for i, (label, pts) in enumerate(curves):
    color = COLORS[i % len(COLORS)]
    line = ' '.join(f'{sx(s):.1f},{sy(v):.1f}' for s, v in pts)
    parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{line}"/>')
    parts.append(f'<text x="{W - PAD - 4}" y="{PAD + 16 * (i + 1)}" text-anchor="end" fill="{color}">'
                 f'{saxutils.escape(label)}: {pts[-1][1]:.4f}</text>')
  return '\n'.join(parts + ['</svg>']) + '\n'


def define_flags():
  flags.DEFINE_list('runs', None, 'Run directories (workdirs), comma-separated.')
  flags.DEFINE_list('labels', None, 'One label per run (default: the directory names).')
  flags.DEFINE_string('out', None, 'The SVG file to write.')
  flags.DEFINE_string('title', 'training loss', 'The picture\'s title.')
  flags.DEFINE_integer('window', 10, 'Steps each point averages.')
  flags.DEFINE_list('metrics', ['loss'], 'The records\' keys to draw, a line each per run.')
  flags.mark_flags_as_required(['runs', 'out'])


def main(argv):
  tools.no_arguments(argv)
  f = flags.FLAGS
  labels = f.labels or [os.path.basename(os.path.normpath(r)) for r in f.runs]
  if len(labels) != len(f.runs):
    tools.fail(f'--labels has {len(labels)} names for {len(f.runs)} runs')
  series = [(label if len(f.metrics) == 1 else (metric if len(f.runs) == 1 else f'{label} {metric}'),
             losses(run, metric)) for label, run in zip(labels, f.runs) for metric in f.metrics]
  text = svg(series, f.title, f.window, f.metrics[0] if len(f.metrics) == 1 else 'value')
  with open(f.out, 'w', encoding='utf-8') as out:
    out.write(text)
  print(f.out)


if __name__ == '__main__':
  define_flags()
  app.run(main)
