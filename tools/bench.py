"""Time training steps: tokens/s, achieved FLOP/s and MFU against the device's peak.

    python -m tools.bench --config=configs/llama_tiny.py
    python -m tools.bench --config=configs/llama_50m.py --steps=5 --warmup=2

Chunked cross-entropy (model.fusions.chunked_cross_entropy), before and after: each value in
a fresh process, the rounds interleaved; peak RSS is the growth of ru_maxrss over a baseline
taken before the model exists (one process per variant: the high-water mark never falls):

    python -m tools.bench --config=configs/llama_tiny.py --config.model.vocab_size=128256 \
        --config.data.seq_length=1024 --config.data.micro_batch_size=1 \
        --config.data.global_batch_size=1 --steps=3 --warmup=1 --chunked_cross_entropy=0,1024

Warm-up steps are excluded; the figure is the median of the timed steps. The peak is the
datasheet bf16 dense figure on CUDA and a measured 2048^3 matmul elsewhere (printed), per
process; MFU divides by peak x world size. Under torchrun every rank prints its view:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m tools.bench \
        --config=configs/llama_tiny.py --config.distributed_strategy.tensor_model_parallel_size=2
"""
import copy
import multiprocessing
import os
import resource
import statistics
import time

from absl import app, flags
from ml_collections import config_flags
import torch

import tools
from configs import validate
from data.loader import Loader
from model import transformer
from optim import update
from parallel import device as devices, mesh as meshes, tensor, training

FLAGS = flags.FLAGS


def bench(config, steps, warmup):
  """Median step time and derived figures as a dict."""
  baseline_rss = _max_rss()
  validate.validate(config, int(os.environ.get('WORLD_SIZE', '1')))
  mesh = meshes.init(config)
  device = mesh.device
  ops = tensor.config_ops(config, mesh)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  loader = Loader(config, 'train', mesh.dp_rank, mesh.dp)
  batches = [loader.global_batch(i * config.data.global_batch_size) for i in range(steps + warmup)]
  times = []
  for step, micro_batches in enumerate(batches):
    devices.synchronize(device)
    start = time.perf_counter()
    training.train_step(params, updater, micro_batches, config, step, mesh, ops)
    devices.synchronize(device)
    times.append(time.perf_counter() - start)
  step_time = statistics.median(times[warmup:])
  tokens = config.data.global_batch_size * config.data.seq_length
  flops = transformer.flops_per_token(config.model, config.data.seq_length) * tokens / step_time
  peak, source = devices.peak_flops(device) if device.type == 'cuda' else (
      devices.measured_matmul_flops(device, n=2048), f'measured fp32 2048^3 matmul on {device.type}')
  return {'name': config.name, 'params': transformer.count_params(config.model), 'mesh': mesh.describe(),
          'device': str(device), 'tokens_per_step': tokens, 'step_time': step_time,
          'tokens_per_sec': tokens / step_time, 'flops': flops, 'peak': peak, 'peak_source': source,
          'mfu': flops / (peak * mesh.world_size), 'threads': torch.get_num_threads(),
          'peak_rss': _max_rss(), 'baseline_rss': baseline_rss, 'pid': os.getpid()}


def _max_rss():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # Linux reports KiB


def _bench_in_child(config, steps, warmup, results):
  results.put(bench(config, steps, warmup))


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
  w = torch.randn(transformer.padded_vocab_size(m, 1), m.hidden_size, generator=g) * m.init_method_std
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
  logits = d.micro_batch_size * d.seq_length * transformer.padded_vocab_size(m, 1)
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
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 3, 'Untimed warm-up steps.')
  flags.DEFINE_list('chunked_cross_entropy', [], 'Compare these model.fusions.chunked_cross_entropy values '
                    '(0 = off), each in a fresh process: peak RSS growth and tokens/s.')
  flags.DEFINE_integer('rounds', 3, 'With --chunked_cross_entropy: fresh processes per value, interleaved.')


def main(argv):
  tools.no_arguments(argv)
  if FLAGS.chunked_cross_entropy:
    values = [int(v) for v in FLAGS.chunked_cross_entropy]
    runs = compare_chunked_cross_entropy(FLAGS.config, values, FLAGS.steps, FLAGS.warmup, FLAGS.rounds)
    print_chunked_cross_entropy(FLAGS.config, runs)
    head = time_head_and_loss(FLAGS.config, values)
    print('  head + loss alone, forward + backward (min of 3, interleaved): ' +
          ', '.join(f'{v}: {t * 1e3:,.0f} ms' for v, t in head.items()))
    return
  r = bench(FLAGS.config, FLAGS.steps, FLAGS.warmup)
  print(f"{r['name']}: {r['params']:,} params on {r['device']} ({r['threads']} threads), "
        f"{r['tokens_per_step']:,} tokens/step")
  print(f"  step time (median of {FLAGS.steps}) {r['step_time'] * 1e3:.1f} ms | "
        f"{r['tokens_per_sec']:,.0f} tokens/s | {r['flops'] / 1e9:.1f} GFLOP/s achieved")
  print(f"  peak {r['peak'] / 1e9:.1f} GFLOP/s per process ({r['peak_source']}) | "
        f"MFU {100 * r['mfu']:.1f}% | {r['mesh']} | peak RSS {r['peak_rss'] / 2**20:.0f} MiB")


if __name__ == '__main__':
  define_flags()
  app.run(main)
