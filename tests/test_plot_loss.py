"""tools/plot_loss.py: runs' metrics.jsonl as one SVG line chart."""
import json
import xml.etree.ElementTree as ET

import pytest

from tools import plot_loss


def _run(path, losses):
  path.mkdir()
  records = [{'step': i + 1, 'loss': v} for i, v in enumerate(losses)] + [{'step': len(losses), 'val_loss': 1.0}]
  (path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


def test_one_line_per_run_smoothed_with_its_last_mean_in_the_legend(tmp_path):
  a = plot_loss.losses(_run(tmp_path / 'a', [4.0, 3.0, 2.0, 1.0]))
  b = plot_loss.losses(_run(tmp_path / 'b', [4.0, 4.0, 2.0, 2.0]))
  assert a == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
  assert plot_loss.smooth(a, 2) == [(1, 4.0), (2, 3.5), (3, 2.5), (4, 1.5)]
  root = ET.fromstring(plot_loss.svg([('bf16', a), ('fp8', b)], 'loss <&>', window=2))
  lines = root.findall('{http://www.w3.org/2000/svg}polyline')
  assert [len(line.get('points').split()) for line in lines] == [4, 4]
  texts = [t.text for t in root.iter('{http://www.w3.org/2000/svg}text')]
  assert 'bf16: 1.5000' in texts and 'fp8: 2.0000' in texts and 'loss <&>' in texts


def test_a_run_without_metrics_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match='metrics.jsonl: no such file'):
    plot_loss.losses(str(tmp_path))


def test_any_metric_of_a_run_and_a_missing_one_named(tmp_path):
  run = _run(tmp_path / 'a', [4.0, 3.0])
  assert plot_loss.losses(run, 'val_loss') == [(2, 1.0)]
  root = ET.fromstring(plot_loss.svg([('val_loss', plot_loss.losses(run, 'val_loss'))], 't', 1, 'val_loss'))
  assert any(t.text == 'val_loss (1-step mean)' for t in root.iter('{http://www.w3.org/2000/svg}text'))
  with pytest.raises(ValueError, match="no record holds 'grad_norm/layers.0'"):
    plot_loss.losses(run, 'grad_norm/layers.0')
