"""tools/bench_ce.py: chunked cross-entropy compared in fresh processes."""
import os

from configs import llama_tiny
from tools import bench_ce


def test_chunked_cross_entropy_comparison_runs_each_value_in_its_own_process():
  """--values: one fresh process per value and round (its own pid, its
  baseline taken before the model exists), and the head timing covers every value."""
  c = llama_tiny.get_config('test')
  runs = bench_ce.compare_chunked_cross_entropy(c, [0, 5], steps=1, warmup=0, rounds=1)
  assert sorted(runs) == [0, 5] and all(len(rs) == 1 for rs in runs.values())
  for (r,) in runs.values():
    assert 0 < r['baseline_rss'] <= r['peak_rss'] and r['pid'] != os.getpid()
  assert runs[0][0]['pid'] != runs[5][0]['pid']
  assert sorted(bench_ce.time_head_and_loss(c, [0, 5], reps=1)) == [0, 5]
