"""A step's fused-update launches, captured once as a CUDA graph and replayed every step after.

On CUDA, bf16SR's update of a 1.1B Llama is 201 compiled calls (optim/sr_update.py), each
60-120 us of dynamo guards and launch wrappers on the host, and they start after the step's one
host sync (the finite check): the GPU waits ~20 ms a step for kernels that take ~6. The calls'
tensors are the same every step (parameters, gradient buckets, moments, cached index layouts);
what changes (the clip coefficient, the scalars of lr and bias corrections, the rounding
seeds) goes in as device tensors. So `run` launches a set of calls directly the first time it
sees them, captures them as one CUDA graph (torch.cuda.graph) the second, with those inputs in
buffers of its own, and from then on copies each step's inputs there and replays: the same
kernels on the same memory, so the same bits, for one launch.
A graph is keyed by every tensor its calls read or write (address, shape, strides, dtype) and
by the inputs' shapes, so anything moved (state reloaded into new tensors, a new parameter
group) is a new key: launched directly once, captured the next time. Off the GPU (CPU, XLA),
while something else captures, with ENABLED off, or after a capture failed (a warning), the
calls just run.
"""
import collections
import logging

import torch

ENABLED = True          # tools/bench_hf.py --nocuda_graph_update: the direct launches, for A/B
_KEEP = 2               # graphs held (an Updater's; a second one's, as in a benchmark's A/B)


class _Graphs:

  def __init__(self):
    self.graphs = collections.OrderedDict()    # key -> (CUDAGraph, the inputs' buffers)
    self.seen = collections.OrderedDict()      # keys launched directly once

  def run(self, launch, fixed, inputs):
    """launch(*inputs), where `launch` reads and writes only the tensors in `fixed` (and values
    that `fixed` holds too; an iterable, read only where a graph may be used) and `inputs`
    (tensors, or None)."""
    if not usable(inputs):
      return launch(*inputs)
    key = (_describe(fixed), tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs))
    entry = self.graphs.get(key)
    if entry is None:
      if key not in self.seen:    # warm-up: compiles and autotuning happen outside any capture
        _remember(self.seen, key, None)
        return launch(*inputs)
      try:
        entry = _capture(launch, inputs)
      except Exception as e:  # pylint: disable=broad-except
        # a capture records launches without running them, so nothing was written: the calls
        # run directly, now and in every later step of this process
        logging.warning('CUDA graph capture of the update failed (%s: %s); launching it call by call',
                        type(e).__name__, str(e).splitlines()[0] if str(e) else '')
        global ENABLED  # pylint: disable=global-statement
        ENABLED = False
        return launch(*inputs)
      _remember(self.graphs, key, entry)
    graph, buffers = entry
    for buffer, value in zip(buffers, inputs):
      if buffer is not None:
        buffer.copy_(value)
    graph.replay()
    return None

  def clear(self):
    self.graphs.clear()
    self.seen.clear()


def usable(inputs) -> bool:
  tensors = [t for t in inputs if t is not None]
  return (ENABLED and bool(tensors) and tensors[0].device.type == 'cuda'
          and not torch.cuda.is_current_stream_capturing())


def _describe(values):
  return tuple((v.data_ptr(), tuple(v.shape), v.stride(), v.dtype) if torch.is_tensor(v) else v for v in values)


def _remember(cache, key, value):
  cache[key] = value
  cache.move_to_end(key)
  while len(cache) > _KEEP:
    cache.popitem(last=False)


def _capture(launch, inputs):
  buffers = [None if t is None else t.clone() for t in inputs]
  graph = torch.cuda.CUDAGraph()
  # thread_local: an async checkpoint's copies on another thread do not break the capture
  with torch.cuda.graph(graph, capture_error_mode='thread_local'):
    launch(*buffers)
  return graph, buffers


_graphs = _Graphs()
run = _graphs.run
clear = _graphs.clear
