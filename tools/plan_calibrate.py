"""`python -m tools.plan --calibrate`: measure this machine and write the planner's `local`
entry (estimates/clusters.py reads it from FLATRON_CLUSTER_FILE or ~/.cache/flatron/local_cluster.json:
outside the repository, as it describes one machine).

A local "device" is one process with one thread (what tools/bench_layouts.py's layouts run),
measured in 2 such processes at once: a 1024^3 matmul per dtype (the peak; matmul_eff is 1
against it), causal SDPA forward + backward at a small model's shape (attn_eff = its FLOP/s
over the fp32 peak) and a large elementwise add (memory bandwidth), each a mean over seconds
of calls (_mean); the framework's overhead (overhead_figures) and the rates the code's
elementwise passes and the head's softmax reach (elementwise_figures), from real train_steps;
then gloo between the 2 processes: all-reduce, all-gather, reduce-scatter and a send/recv pair
at 8 bytes, 512 KiB and 16 MiB, means of 30 back-to-back calls, kept per operation as measured
curves (op_times: what estimates/step_time.py reads for a pair of local ranks) and fitted to
one alpha-beta line (intra/inter bandwidth and latency). One node: intra = inter. Last, the two
processes run real tp2 steps (tp_wait_figures): what a blocking TP collective waits for the
other rank beyond its back-to-back time (sync_wait).
"""
import dataclasses
import os
import socket
import time
from unittest import mock
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from estimates import clusters, memory, memory_check
from tools import link_fit


def _mean(fn, seconds=2.0):
  """Mean seconds per call of `fn` over at least `seconds` of calls: on a shared machine what a
  training step of that length sees (a short best-of-N or median swings 2x with the load)."""
  fn()
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    fn()
    calls += 1
  return (time.perf_counter() - start) / calls


def _mean_of_calls(fn, calls=30):
  """Mean seconds of `calls` back-to-back calls of `fn` (a collective: a fixed count, so both
  ranks make the same calls). Not a median: gloo's calls here take 0.2 or 3 ms by how the
  processes happen to be scheduled, and a step pays the mean of that over its hundreds."""
  fn()
  start = time.perf_counter()
  for _ in range(calls):
    fn()
  return (time.perf_counter() - start) / calls


def compute_figures(threads=1) -> dict:
  """{'peak': {dtype: FLOP/s}, 'attn_eff', 'mem_bw'} of one process at `threads` threads."""
  before = torch.get_num_threads()
  torch.set_num_threads(threads)
  try:
    peak = {}
    for name, dtype in (('fp32', torch.float32), ('bf16', torch.bfloat16)):
      a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
      peak[name] = 2 * 1024**3 / _mean(lambda: a @ b)     # pylint: disable=cell-var-from-loop
    b, heads, s, d = 2, 8, 256, 32
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))

    def attention():
      F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    flops = 3 * 2 * b * s * s * heads * d          # forward (causal half of 4 b s^2 a d) + backward 2x
    attn_eff = flops / _mean(attention, 1.0) / peak['fp32']
    x, y = torch.randn(2**24), torch.randn(2**24)
    mem_bw = 3 * 4 * 2**24 / _mean(lambda: torch.add(x, y, out=x), 1.0)
    return {'peak': peak, 'attn_eff': attn_eff, 'mem_bw': mem_bw}
  finally:
    torch.set_num_threads(before)


# The framework's own cost: what a step of a model too small to compute anything still takes
# (Python, the dispatcher, autograd, the optimizer's per-tensor loop). Fitted over layers L and
# micro batches M as t(L, M) = step + M micro + L layer_step + L M layer (seconds).
OVERHEAD_SHAPE = {'model.hidden_size': 32, 'model.ffn_hidden_size': 64, 'model.num_attention_heads': 2,
                  'model.num_kv_heads': 1, 'model.vocab_size': 128, 'model.max_position_embeddings': 16,
                  'data.seq_length': 16, 'data.micro_batch_size': 1}


def _config(overrides):
  """configs/llama_tiny.py with `overrides` ({'a.b': value}), fp32 on the CPU."""
  from configs import cli  # pylint: disable=import-outside-toplevel
  config = cli.load('configs/llama_tiny.py')
  for key, value in {**overrides, 'precision.type': 'fp32', 'device': 'cpu'}.items():
    *parents, leaf = key.split('.')
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


def _step_seconds(config, seconds=1.0, calls=None):
  """Mean seconds of a train_step of `config` in this process (what tools/bench.py runs), over
  `seconds` of steps, or over `calls` steps (ranks of one world must make the same calls)."""
  from tools import bench  # pylint: disable=import-outside-toplevel
  run = bench.Run.build(config, 1)
  run.batches = run.batches * 10**6          # the same batch again: the data is not what is timed
  return _mean(run.step, seconds) if calls is None else _mean_of_calls(run.step, calls)


def overhead_figures() -> dict:
  """{'layer', 'layer_step', 'micro', 'step'}: seconds of framework overhead per layer and micro
  batch (forward + backward), per layer and step (its parameters' optimizer loop), per micro
  batch outside the layers (embedding, head, loss) and per step, from t(L, M) at L, M in {1, 3}."""
  return fit_overhead({(l, m): _step_seconds(_config({**OVERHEAD_SHAPE, 'model.num_layers': l,
                                                     'data.global_batch_size': m}))
                       for l in (1, 3) for m in (1, 3)})


def fit_overhead(t) -> dict:
  """overhead_figures' terms from {(layers, micro batches): seconds} at 1 and 3 of each."""
  layer = max(0.0, ((t[3, 3] - t[1, 3]) - (t[3, 1] - t[1, 1])) / 4)
  layer_step = max(0.0, (t[3, 1] - t[1, 1]) / 2 - layer)
  micro = max(0.0, (t[1, 3] - t[1, 1]) / 2 - layer)
  return {'layer': layer, 'layer_step': layer_step, 'micro': micro,
          'step': max(0.0, t[1, 1] - layer - layer_step - micro)}


# Where elementwise work and the head's softmax are a real share of the step: bench_layouts'
# small shape at 2 layers, at two vocabularies to tell the two apart.
ELEMENTWISE_SHAPE = {'model.num_layers': 2, 'model.hidden_size': 256, 'model.ffn_hidden_size': 688,
                     'model.num_attention_heads': 8, 'model.num_kv_heads': 4, 'model.max_position_embeddings': 256,
                     'data.seq_length': 256, 'data.micro_batch_size': 2}


def elementwise_figures(cluster) -> dict:
  """{'ew_bw', 'logit_s'}: what a micro batch takes beyond `cluster`'s prediction of its GEMMs,
  attention and overheads (measured above), fitted as elementwise bytes (micro_batch_cost's
  count) at ew_bw plus logit elements at logit_s, from steps at two vocabularies, each at 1 and
  3 micro batches: the difference leaves out what a step pays once (the embedding's and head's
  gradients zeroed and updated), which would otherwise be charged to every micro batch."""
  from model import param_table  # pylint: disable=import-outside-toplevel
  from estimates import micro_batch_cost, step_time  # pylint: disable=import-outside-toplevel
  bare = dataclasses.replace(cluster, ew_bw=float('inf'), logit_s=1e-300)
  rows, rest = [], []
  for vocab in (512, 8192):
    beyond = []
    for micro in (1, 3):
      config = _config({**ELEMENTWISE_SHAPE, 'model.vocab_size': vocab,
                        'data.global_batch_size': micro * ELEMENTWISE_SHAPE['data.micro_batch_size']})
      beyond.append(_step_seconds(config, 1.5) - step_time.predict(config, bare, 1).step_s)
    a, m = config.data, config.model
    rows.append((3 * m.num_layers * sum(micro_batch_cost.elementwise_bytes(config, 1)),
                 a.micro_batch_size * a.seq_length * param_table.padded_vocab_size(m, 1)))
    rest.append((beyond[1] - beyond[0]) / 2)
  return fit_elementwise(rows, rest, cluster.mem_bw)


def fit_elementwise(rows, rest, mem_bw) -> dict:
  """elementwise_figures' terms from [(elementwise bytes, logit elements)] and the seconds
  beyond the prediction, at two vocabularies."""
  (b0, l0), (b1, l1) = rows
  det = b0 * l1 - b1 * l0
  inv_bw = (rest[0] * l1 - rest[1] * l0) / det
  logit_s = (b0 * rest[1] - b1 * rest[0]) / det
  # a fit below the streaming rate's cost is noise: keep the datasheet term there
  return {'ew_bw': 1 / inv_bw if inv_bw * mem_bw > 1 else mem_bw, 'logit_s': max(logit_s, 24 / mem_bw)}


def tp_wait_figures(cluster, rank) -> dict:
  """{'sync_wait'}: seconds each blocking TP collective waits beyond its back-to-back time
  (`cluster`'s op_times, measured with both ranks arriving together), from real tp2 steps of
  bench_layouts' small shape (4 layers: the layers' collectives, not the head's, dominate) at 1
  and 3 micro batches, both processes of this world running them: what a micro batch takes
  beyond `cluster`'s prediction of it, over its blocking TP collectives."""
  from estimates import step_time  # pylint: disable=import-outside-toplevel
  beyond, calls = [], []
  with mock.patch.dict(os.environ, WORLD_SIZE='2', RANK=str(rank), LOCAL_RANK=str(rank)):   # a tp2 world
    for micro in (1, 3):
      config = _config({**ELEMENTWISE_SHAPE, 'model.num_layers': 4, 'model.vocab_size': 4096,
                        'distributed_strategy.tensor_model_parallel_size': 2,
                        'data.global_batch_size': micro * ELEMENTWISE_SHAPE['data.micro_batch_size']})
      beyond.append(_step_seconds(config, calls=8) - step_time.predict(config, cluster, 2).step_s)
      calls.append(step_time.blocking_tp_calls(config, cluster, 2))
  return {'sync_wait': fit_sync_wait((beyond[1] - beyond[0]) / 2, (calls[1] - calls[0]) / 2)}


def fit_sync_wait(beyond_per_micro, calls_per_micro) -> float:
  """The wait per blocking collective: what a micro batch takes beyond the prediction, over its
  blocking TP collectives (none below 0: a faster step than predicted is not a negative wait)."""
  return max(0.0, beyond_per_micro / calls_per_micro)


def _worker(rank, port, out):
  """Both processes measure the compute figures at once (the layouts run 2 busy ranks: they
  share caches, memory bandwidth and the other jobs' cores), then the collectives."""
  os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
  torch.set_num_threads(1)
  warnings.simplefilter('ignore', FutureWarning)     # all_gather_into_tensor's rename (torch 2.13)
  dist.init_process_group('gloo', rank=rank, world_size=2)
  try:
    dist.barrier()
    compute = compute_figures(1)
    dist.barrier()
    compute['overhead'] = overhead_figures()
    compute.update(elementwise_figures(_local(compute)))
    dist.barrier()
    figures = link_fit.collective_figures(rank, _mean_of_calls)
    dist.barrier()
    compute.update(tp_wait_figures(link_fit.with_links(_local(compute), figures), rank))
    if rank == 0:
      out.put((compute, figures))
  finally:
    dist.destroy_process_group()


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def measure() -> tuple:
  """(compute figures, {size: {op: seconds}}) of 2 gloo processes of 1 thread (spawned; killed
  if still alive after)."""
  ctx = mp.get_context('spawn')
  out = ctx.Queue()
  port = _free_port()
  procs = [ctx.Process(target=_worker, args=(rank, port, out), daemon=True) for rank in range(2)]
  try:
    for p in procs:
      p.start()
    result = out.get(timeout=300)
    for p in procs:
      p.join(timeout=60)
    return result
  finally:
    for p in procs:
      if p.is_alive():
        p.kill()
        p.join()


def _local(compute, base=clusters.LOCAL_DEFAULT):
  """`base` with the compute figures measured (all of them that `compute` has yet)."""
  over = compute['overhead']
  return dataclasses.replace(
      base, peak=compute['peak'], attn_eff=compute['attn_eff'], mem_bw=compute['mem_bw'],
      ew_bw=compute.get('ew_bw', 0.0), logit_s=compute.get('logit_s', 0.0), sync_wait=compute.get('sync_wait', 0.0),
      layer_overhead=over['layer'], layer_step_overhead=over['layer_step'], micro_overhead=over['micro'],
      step_overhead=over['step'])


def calibrated(base=clusters.LOCAL_DEFAULT):
  """`base` with everything measured now: what --calibrate writes, and what tools/bench_plan.py
  measures again before each layout (a shared machine's load moves the figures 2x in minutes)."""
  compute, figures = measure()
  available = memory_check.host_available_bytes() or base.memory_bytes * 2
  entry = dataclasses.replace(
      link_fit.with_links(_local(compute, base), figures), memory_bytes=available / 2,
      source=f'measured by tools/plan.py --calibrate on {time.strftime("%Y-%m-%d %H:%M")}')
  return entry, compute, figures


def define_flags():
  """No flags of its own: `python -m tools.plan --calibrate` runs main()."""


def main():
  entry, compute, figures = calibrated()
  path = clusters.write_local(entry)
  print(f'fp32 matmul {compute["peak"]["fp32"] / 1e9:.1f} GFLOP/s, bf16 {compute["peak"]["bf16"] / 1e9:.1f} GFLOP/s '
        f'(1 thread); SDPA fwd+bwd at {compute["attn_eff"]:.0%} of fp32 peak; memory {compute["mem_bw"] / 1e9:.1f} GB/s')
  over = compute['overhead']
  print(f'elementwise passes {compute["ew_bw"] / 1e9:.1f} GB/s, head softmax + loss {compute["logit_s"] * 1e9:.2f} ns '
        f'per logit; framework overhead {over["layer"] * 1e3:.3f} ms per layer and micro batch, '
        f'{over["layer_step"] * 1e3:.3f} ms per layer and step, {over["micro"] * 1e3:.3f} ms per micro batch, '
        f'{over["step"] * 1e3:.3f} ms per step')
  print(f'a blocking TP collective waits {compute["sync_wait"] * 1e3:.3f} ms for the other rank beyond its '
        'back-to-back time (fitted from tp2 steps)')
  for size, ops in figures.items():
    print(f'gloo, 2 processes, {4 * size} bytes: ' + ', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in ops.items()))
  print(f'alpha-beta fit: {entry.intra_bw / 1e9:.2f} GB/s, {entry.intra_lat * 1e6:.0f} us per step; per collective: '
        + ', '.join(f'{op} {bw / 1e9:.2f} GB/s {lat * 1e6:.0f} us' for op, (bw, lat) in
                    ((op, link_fit.fit(figures, op)) for op in link_fit.ALPHA_BETA))
        + f'; memory per process {memory.human_bytes(entry.memory_bytes)}\nwrote {path}')
