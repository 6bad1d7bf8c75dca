"""Chunked cross-entropy (model.fusions.chunked_cross_entropy) before and after: each value in a
fresh process, the rounds interleaved; peak RSS is the growth of ru_maxrss over a baseline taken
before the model exists (one process per variant: the high-water mark never falls).

    python -m tools.bench_ce --config=configs/llama_tiny.py --config.model.vocab_size=128256 \
        --config.data.seq_length=1024 --config.data.micro_batch_size=1 \
        --config.data.global_batch_size=1 --steps=3 --warmup=1 --values=0,256,1024

It also times the LM head and the loss alone (forward + backward), interleaved in one process.
"""
import copy
import multiprocessing
import statistics
import time

from absl import app, flags
from ml_collections import config_flags
import torch

import tools
from model import param_table
from tools import bench

FLAGS = flags.FLAGS


def _bench_in_child(config, steps, warmup, results):
  results.put(bench.bench(config, steps, warmup))


def compare_chunked_cross_entropy(config, values, steps, warmup, rounds):
  """{value: [bench() of each round]}: model.fusions.chunked_cross_entropy at each of
  `values`, every run in a fresh spawned process, the values interleaved round by round."""
  ctx = multiprocessing.get_context('spawn')
  out = {v: [] for v in values}
  for _ in range(rounds):
    for value in values:
      variant = copy.deepcopy(config)
      variant.model.fusions.chunked_cross_entropy = value
      results = ctx.Queue()
      child = ctx.Process(target=_bench_in_child, args=(variant, steps, warmup, results), daemon=True)
      child.start()
      try:
        out[value].append(results.get(timeout=3600))
      finally:
        child.join(timeout=5)
        if child.is_alive():
          child.kill()
  return out


def time_head_and_loss(config, values, reps=3):
  """{value: seconds}: the LM head and next-token loss alone, forward + backward, on random
  inputs of one micro batch (fp32, one process), the values interleaved; min of `reps`."""
  from model import chunked_ce, layers  # pylint: disable=import-outside-toplevel
  d, m = config.data, config.model
  g = torch.Generator().manual_seed(0)
  x = torch.randn(d.micro_batch_size, d.seq_length, m.hidden_size, generator=g)
  w = torch.randn(param_table.padded_vocab_size(m, 1), m.hidden_size, generator=g) * m.init_method_std
  labels = torch.randint(0, m.vocab_size, (d.micro_batch_size, d.seq_length), generator=g)
  out = {v: [] for v in values}
  for _ in range(reps):
    for value in values:
      xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
      start = time.perf_counter()
      head = chunked_ce.HeadInput(xx, ww, value) if value else layers.LOCAL_OPS.lm_head(xx, ww)
      chunked_ce.token_losses(head, labels, m, layers.LOCAL_OPS).sum().backward()
      out[value].append(time.perf_counter() - start)
  return {v: min(t) for v, t in out.items()}


def print_chunked_cross_entropy(config, runs):
  d, m = config.data, config.model
  logits = d.micro_batch_size * d.seq_length * param_table.padded_vocab_size(m, 1)
  print(f"{config.name}: vocab {m.vocab_size:,}, micro batch {d.micro_batch_size} x seq {d.seq_length}: "
        f"fp32 logits {logits * 4 / 2**20:,.0f} MiB per copy (tp 1)")
  for value, rs in runs.items():
    growth = statistics.median(r['peak_rss'] - r['baseline_rss'] for r in rs)
    label = 'off' if value == 0 else f'{value} tokens'
    each = ', '.join(f"{r['tokens_per_sec']:,.0f}" for r in rs)
    print(f"  chunked_cross_entropy={value} ({label}): peak RSS over baseline {growth / 2**20:,.0f} MiB | "
          f"{statistics.median(r['tokens_per_sec'] for r in rs):,.0f} tokens/s "
          f"(median of {len(rs)} fresh processes: {each})")


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).')
  flags.mark_flag_as_required('config')
  flags.DEFINE_integer('steps', 3, 'Timed steps.')
  flags.DEFINE_integer('warmup', 1, 'Untimed warm-up steps.')
  flags.DEFINE_list('values', ['0', '1024'], 'model.fusions.chunked_cross_entropy values to compare (0 = off).')
  flags.DEFINE_integer('rounds', 3, 'Fresh processes per value, interleaved.')


def main(argv):
  tools.no_arguments(argv)
  values = [int(v) for v in FLAGS.values]
  runs = compare_chunked_cross_entropy(FLAGS.config, values, FLAGS.steps, FLAGS.warmup, FLAGS.rounds)
  print_chunked_cross_entropy(FLAGS.config, runs)
  head = time_head_and_loss(FLAGS.config, values)
  print('  head + loss alone, forward + backward (min of 3, interleaved): ' +
        ', '.join(f'{v}: {t * 1e3:,.0f} ms' for v, t in head.items()))


if __name__ == '__main__':
  define_flags()
  app.run(main)
