"""tools/bench_layouts.py: its train.py runner reads what the loop logs (the timed steps from
metrics.jsonl, every rank's peak against its estimate from the run's last line)."""
import os
import sys

from tools import bench_layouts


def test_the_train_runner_reads_the_loops_steps_and_every_ranks_peak():
  cmd = [sys.executable, 'train.py', '--config=configs/llama_tiny.py:test', '--config.trainer.max_steps=3',
         '--config.trainer.log_every_n_steps=1', '--config.trainer.val_check_interval=0',
         '--config.exp_manager.create_tensorboard_logger=False', '--config.model.optim.sched.warmup_steps=0']
  tokens_per_s, whole, grown, error = bench_layouts._run_train(cmd, dict(os.environ, OMP_NUM_THREADS='1'), 240, 2)  # pylint: disable=protected-access
  assert tokens_per_s > 0 and whole > grown >= 0 and -100 <= error < 1000   # (a tiny run may not pass the import's peak)
