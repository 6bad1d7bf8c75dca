"""What a benchmarked step is measured against, and where its time goes (tools/bench_hf.py): the
ceiling (the step's GEMMs and attention timed alone), a step's ops under torch.profiler, and a
GPU's busy and idle time within it."""
import functools
import time

import torch
import torch.nn.functional as F

from model import param_table, transformer
from parallel import device as devices


def ceiling_step_time(config, dtype, clock=time.perf_counter, device=torch.device('cpu'), repeats=3):
  """Seconds per step for the step's GEMMs (forward, and both backward products) and SDPA
  forward + backward (causal, grouped KV heads) only, each timed alone (best of `repeats`), per
  micro batch times the micro batches of a step."""
  m, d = config.model, config.data
  tokens, hd = d.micro_batch_size * d.seq_length, transformer.head_dim(m)
  heads, kv = m.num_attention_heads, param_table.kv_heads(m)
  shapes = [(heads * hd, m.hidden_size), (kv * hd, m.hidden_size), (kv * hd, m.hidden_size),
            (m.hidden_size, heads * hd), (m.ffn_hidden_size, m.hidden_size), (m.ffn_hidden_size, m.hidden_size),
            (m.hidden_size, m.ffn_hidden_size)] * m.num_layers + [(m.vocab_size, m.hidden_size)]

  def best(fn):
    fn()
    times = []
    for _ in range(repeats):
      devices.synchronize(device)
      start = clock()
      fn()
      devices.synchronize(device)
      times.append(clock() - start)
    return min(times)

  randn = functools.partial(torch.randn, dtype=dtype, device=device)
  total = 0.0
  for out_f, in_f in set(shapes):
    x, w, g = randn(tokens, in_f), randn(out_f, in_f), randn(tokens, out_f)
    t = best(lambda: (x @ w.t(), g @ w, g.t() @ x))       # forward, input grad, weight grad
    total += t * shapes.count((out_f, in_f))
  # the step's attention: grouped KV heads, and a dense output gradient (a `.sum()`'s stride-0
  # one made the CPU's bf16 flash backward 37% slower than the step's: 43.4 against 31.6 ms)
  b, s = d.micro_batch_size, d.seq_length
  q, k, v = (randn(b, n, s, hd, requires_grad=True) for n in (heads, kv, kv))
  grad = randn(b, heads, s, hd)
  attention = best(lambda: torch.autograd.grad(
      F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv < heads), (q, k, v), grad))
  micro_batches = d.global_batch_size // d.micro_batch_size
  total, attention = total * micro_batches, attention * m.num_layers * micro_batches
  return total + attention, total, attention



def profile_step(step_fn, device, rows=15):
  """step_fn() under torch.profiler: the `rows` ops with the most self CPU time, and on a GPU
  how long it worked within the step (gpu_busy)."""
  activities = [torch.profiler.ProfilerActivity.CPU]
  if device.type == 'cuda':
    activities.append(torch.profiler.ProfilerActivity.CUDA)
  devices.synchronize(device)
  with torch.profiler.profile(activities=activities) as prof:
    step_fn()
    devices.synchronize(device)
  table = prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=rows)
  return table + ('\n' + gpu_busy(prof.events()) if device.type == 'cuda' else '')


def gpu_busy(events, gaps=5):
  """The GPU's work (kernels, copies, fills; overlaps counted once) against the profiled span,
  and its longest idle gaps: where a step waits on its host (launch overhead, syncs)."""
  cpu = [e.time_range for e in events if e.device_type == torch.autograd.DeviceType.CPU]
  spans = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
  if not cpu or not spans:
    return 'no GPU work recorded'
  start, end = min(r.start for r in cpu), max(r.end for r in cpu)
  busy, idle, at = 0, [], start
  for a, b in spans:
    if a > at:
      idle.append((a - at, at - start))
    busy += max(0, b - max(a, at))
    at = max(at, b)
  idle.append((max(0, end - at), at - start))
  longest = ', '.join(f'{g / 1e3:.1f} ms at {t / 1e3:.0f} ms' for g, t in sorted(idle, reverse=True)[:gaps])
  return (f'GPU busy {busy / 1e3:.1f} ms of {(end - start) / 1e3:.1f} ms ({busy / max(end - start, 1):.0%}); '
          f'idle {sum(g for g, _ in idle) / 1e3:.1f} ms in {len(idle)} gaps, the longest: {longest}')
