"""What a collective costs on a cluster's links (estimates/clusters.py): the alpha-beta rings
estimates/step_time.py charges every TP, SP, CP, EP, PP and DP exchange with.

A group of g ranks `stride` apart (rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp +
tp_rank) stays in a node when g * stride fits it; else its bandwidth is the node's inter-node
share per device times the members it has per node (they share the crossing), at most the
intra-node link. All-reduce 2(g-1)(alpha + n/(g B)), all-gather, reduce-scatter and all-to-all
(g-1)(alpha + n/(g B)), p2p alpha + n/B. For a pair of ranks in a node of a cluster with
measured op_times (`local`, tools/link_fit.py), each operation is read off its own
measured curve instead of one line.
"""


def link(cluster, size, stride=1, op=None, n=None) -> tuple:
  """(bandwidth bytes/s, latency s) of a ring over `size` ranks `stride` apart. For a pair of
  ranks in a node of a cluster with measured op_times (`local`), the line through the two
  measured sizes around `n` bytes (the formula's n) of collective `op`, as alpha and beta."""
  per_node = cluster.devices_per_node
  if size * stride <= per_node:
    curve = (cluster.op_times or {}).get(op)
    if curve and size == 2 and n is not None:
      return _segment(op, curve, n)
    return cluster.intra_bw * cluster.link_eff, cluster.intra_lat
  members = max(1, per_node // stride)          # this group's ranks in one node
  return min(cluster.intra_bw, cluster.inter_bw * members) * cluster.link_eff, cluster.inter_lat


def _segment(op, curve, n) -> tuple:
  """(bandwidth, latency) at g = 2 of the line t = a + b n through the measured [n, seconds]
  points around n (the last two past the ends), as the op's formula reads them."""
  points = sorted(curve)
  i = next((k for k in range(1, len(points)) if n <= points[k][0]), len(points) - 1)
  (n0, t0), (n1, t1) = points[max(i - 1, 0)], points[i]
  b = max((t1 - t0) / (n1 - n0), 1e-15) if n1 > n0 else 1e-15     # noise can make a segment fall
  a = max(t0 - b * n0, 0.0)
  if op == 'all_reduce':                 # 2 (alpha + n / 2B)
    return 1 / b, a / 2
  if op == 'p2p':                        # alpha + n / B
    return 1 / b, a
  return 1 / (2 * b), a                  # all-gather (n the output), reduce-scatter, all-to-all: alpha + n / 2B


def all_reduce(n, g, bw, lat) -> float:
  return 0.0 if g == 1 else 2 * (g - 1) * (lat + n / (g * bw))


def all_gather(n, g, bw, lat) -> float:
  """`n` bytes gathered (the output); a reduce-scatter of `n` input bytes costs the same."""
  return 0.0 if g == 1 else (g - 1) * (lat + n / (g * bw))


reduce_scatter = all_to_all = all_gather    # all-to-all: `n` bytes held, (g-1)/g of them sent


def p2p(n, bw, lat) -> float:
  return lat + n / bw


_FORMULAS = {'all_reduce': all_reduce, 'all_gather': all_gather, 'reduce_scatter': reduce_scatter,
             'all_to_all': all_to_all}


def collective(cluster, op, n, g, stride=1) -> float:
  """Seconds of `op` ('p2p' or a _FORMULAS key) on `n` bytes (the formula's n) among g ranks
  `stride` apart, on cluster's links (link())."""
  if g == 1:
    return 0.0
  if op == 'p2p':
    return p2p(n, *link(cluster, g, stride, op, n))
  return _FORMULAS[op](n, g, *link(cluster, g, stride, op, n))
