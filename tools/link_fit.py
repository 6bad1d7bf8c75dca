"""The collectives between two local processes (`python -m tools.plan --calibrate`,
tools/plan_calibrate.py): their timings, the alpha-beta line fitted to them, and the measured
curves the planner reads (op_times)."""
import dataclasses

import torch
import torch.distributed as dist


SIZES = (2, 2**17, 2**22)           # fp32 elements: 8 bytes, 512 KiB (a small model's TP activations), 16 MiB


def collective_figures(rank, mean_of_calls) -> dict:
  """{fp32 elements: {op: seconds}}: gloo's all-reduce, all-gather, reduce-scatter and a send /
  recv pair between this rank and the other of 2, each the mean of back-to-back calls."""
  figures = {}
  for size in SIZES:
    t = torch.ones(size)
    gathered, half = torch.empty(2 * size), torch.empty(size // 2)
    peer = 1 - rank

    def exchange():
      if rank == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
      else:
        dist.recv(t, peer)
        dist.send(t, peer)
    figures[size] = {'all_reduce': mean_of_calls(lambda: dist.all_reduce(t)),
                     'all_gather': mean_of_calls(lambda: dist.all_gather_into_tensor(gathered, t)),
                     'reduce_scatter': mean_of_calls(lambda: dist.reduce_scatter_tensor(half, t)),
                     'p2p': mean_of_calls(exchange) / 2}
  return figures


# At g = 2, n the bytes each rank gives: seconds = alpha x a + n / B x b for (a, b) of the op.
ALPHA_BETA = {'all_reduce': (2.0, 1.0), 'all_gather': (1.0, 1.0), 'reduce_scatter': (1.0, 0.5), 'p2p': (1.0, 1.0)}


def fit(figures, only=None) -> tuple:
  """(bandwidth, latency) of the alpha-beta rings at g = 2, fitted to the timings in `figures`
  ({fp32 elements: {op: seconds}}; of the op `only`, else of all) by least squares in relative
  error: all-reduce 2 alpha + n/B, all-gather alpha + n/B (n the bytes each rank gives),
  reduce-scatter alpha + n/2B, p2p alpha + n/B."""
  rows, times = [], []
  for size, ops in figures.items():
    for op, seconds in ops.items():
      if only in (None, op):
        a, b = ALPHA_BETA[op]
        rows.append([a, 4 * size * b])
        times.append(seconds)
  a, t = torch.tensor(rows, dtype=torch.float64), torch.tensor(times, dtype=torch.float64)
  lat, inv_bw = torch.linalg.lstsq(a / t[:, None], torch.ones_like(t)).solution.tolist()
  return 1 / max(inv_bw, 1e-30), max(lat, 0.0)


def op_times(figures) -> dict:
  """{op: [[n, seconds], ...]} for clusters.Cluster.op_times from `figures` ({fp32 elements:
  {op: seconds}} at g = 2), n as step_time's formulas read it: the all-reduce's buffer, the
  all-gather's output (2x what each rank gives), the reduce-scatter's input, what p2p sends;
  all-to-all as the all-gather (the same bytes sent)."""
  scale = {'all_reduce': 4, 'all_gather': 8, 'reduce_scatter': 4, 'p2p': 4}
  times = {op: sorted([k * size, ops[op]] for size, ops in figures.items()) for op, k in scale.items()}
  return dict(times, all_to_all=times['all_gather'])


def with_links(cluster, figures):
  """`cluster` with the collectives measured in `figures`: the alpha-beta fit (one node: intra =
  inter) and each operation's curve."""
  bw, lat = fit(figures)
  return dataclasses.replace(cluster, intra_bw=bw, inter_bw=bw, intra_lat=lat, inter_lat=lat,
                             op_times=op_times(figures))
