"""`python -m tools.plan --calibrate`: measure this machine and write the planner's `local`
entry (parallel/clusters.py reads it from FLATRON_CLUSTER_FILE or ~/.cache/flatron/local_cluster.json:
outside the repository, as it describes one machine).

A local "device" is one process with one thread (what tools/bench_layouts.py's layouts run),
measured in 2 such processes at once: a 1024^3 matmul per dtype (the peak; matmul_eff is 1
against it), causal SDPA forward + backward at a small model's shape (attn_eff = its FLOP/s
over the fp32 peak) and a large elementwise add (memory bandwidth), each a mean over seconds
of calls (_mean); then gloo between the 2 processes: all-reduce, all-gather and a send/recv
pair at 8 bytes (latency) and 16 MiB (bandwidth), medians of 7, fitted to the alpha-beta
formulas of parallel/step_time.py. One node: intra = inter.
"""
import dataclasses
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from parallel import clusters, memory


def _mean(fn, seconds=2.0):
  """Mean seconds per call of `fn` over at least `seconds` of calls: on a shared machine what a
  training step of that length sees (a short best-of-N or median swings 2x with the load)."""
  fn()
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    fn()
    calls += 1
  return (time.perf_counter() - start) / calls


def _median(fn, repeats=7):
  """Median seconds of `fn` (the collectives: short calls that share the machine's load)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


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
    figures = {}
    for size in (2, 2**22):                       # fp32 elements: 8 bytes, 16 MiB
      t = torch.ones(size)
      gathered = torch.empty(2 * size)
      peer = 1 - rank

      def exchange():
        if rank == 0:
          dist.send(t, peer)
          dist.recv(t, peer)
        else:
          dist.recv(t, peer)
          dist.send(t, peer)
      figures[size] = {'all_reduce': _median(lambda: dist.all_reduce(t)),
                       'all_gather': _median(lambda: dist.all_gather_into_tensor(gathered, t)),
                       'p2p': _median(exchange) / 2}
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


def fit(figures) -> tuple:
  """(bandwidth, latency) of the alpha-beta rings at g = 2 from the small and large timings:
  all-reduce 2(alpha + n/(2B)), all-gather alpha + n/(2B) (n the output), p2p alpha + n/B."""
  small, large = figures[2], figures[2**22]
  n = 4 * 2**22
  lat = min(small['all_reduce'] / 2, small['all_gather'], small['p2p'])
  bws = [n / max(large['all_reduce'] - 2 * lat, 1e-9), n / max(large['all_gather'] - lat, 1e-9),
         n / max(large['p2p'] - lat, 1e-9)]
  return sorted(bws)[1], lat            # the median of the three operations' bandwidths


def calibrated(base=clusters.LOCAL_DEFAULT):
  """`base` with everything measured now: what --calibrate writes, and what tools/bench_plan.py
  measures again before each layout (a shared machine's load moves the figures 2x in minutes)."""
  compute, figures = measure()
  bw, lat = fit(figures)
  available = memory.host_available_bytes() or base.memory_bytes * 2
  entry = dataclasses.replace(
      base, peak=compute['peak'], attn_eff=compute['attn_eff'], mem_bw=compute['mem_bw'],
      intra_bw=bw, inter_bw=bw, intra_lat=lat, inter_lat=lat, memory_bytes=available / 2,
      source=f'measured by tools/plan.py --calibrate on {time.strftime("%Y-%m-%d %H:%M")}')
  return entry, compute, figures


def define_flags():
  """No flags of its own: `python -m tools.plan --calibrate` runs main()."""


def main():
  entry, compute, figures = calibrated()
  path = clusters.write_local(entry)
  print(f'fp32 matmul {compute["peak"]["fp32"] / 1e9:.1f} GFLOP/s, bf16 {compute["peak"]["bf16"] / 1e9:.1f} GFLOP/s '
        f'(1 thread); SDPA fwd+bwd at {compute["attn_eff"]:.0%} of fp32 peak; memory {compute["mem_bw"] / 1e9:.1f} GB/s')
  for size, ops in figures.items():
    print(f'gloo, 2 processes, {4 * size} bytes: ' + ', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in ops.items()))
  print(f'alpha-beta fit: {entry.intra_bw / 1e9:.2f} GB/s, {entry.intra_lat * 1e6:.0f} us per step; memory per '
        f'process {memory.human_bytes(entry.memory_bytes)}\nwrote {path}')
