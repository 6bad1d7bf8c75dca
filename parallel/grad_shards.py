"""ZeRO-2: the gradients sharded like the optimizer state (distributed_strategy.zero_stage=2).

The buckets have ZeRO-1's layout (parallel/grad_buffer.py: [parts, S], part k the rows rank k
owns), but a bucket's whole buffer exists only while one backward pass fills it. Once every
parameter in it has had the pass's gradient (or the pass ends) it is reduced over DP, this
rank's part is added into the bucket's `owned` [S] accumulator and the buffer is freed. Between
passes a rank so keeps 1/dp of its gradients, and during one the buckets being filled and at
most IN_FLIGHT reductions (on gloo one: its receive buffer). Freed whole buffers (each the size
of the largest bucket) are kept and reused by the next buckets.

The price is traffic: one reduction per micro batch, not per step, as DeepSpeed's stage 2 and
FSDP without no_sync do under gradient accumulation. The sums are ZeRO-1's in another order
(each micro batch summed over DP first, then the micro batches): equal within round-off, not
bitwise.
"""
import torch
import torch.distributed as dist

from parallel import comm, grad_buffer, grad_reduce, zero

IN_FLIGHT = 2        # reductions in flight at once, each holding its whole bucket until it is folded


class ShardedGradBuffer(grad_buffer.GradBuffer):

  WHOLE_BUCKETS = False

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.flying, self.queued = [], False
    # freed whole buffers, kept for the next bucket of their dtype: each pass reuses the same few
    # (on the CPU a fresh one per bucket and pass left the heap holding them all)
    self.spare = {}
    self.largest = {}
    for b in self.buckets:
      self.largest[b.dtype] = max(self.largest.get(b.dtype, 0), b.parts * b.size)
    for b in self.buckets:
      b.owned = torch.zeros(b.size, dtype=b.dtype, device=b.device)
      b.passes = 0                  # backward passes reduced into `owned` (or in flight) this step

  def accumulate(self, name, grad):
    """Add one backward's gradient of `name` into its bucket's whole buffer (made at the pass's
    first gradient), and reduce the bucket once each of its parameters has had this pass's."""
    bucket = self.buckets[self.bucket_of[name]]
    if self.expected is not None and self.counts[name] >= self.expected:
      raise RuntimeError(f'a gradient of {name} arrived after its bucket was reduced: more backward '
                         f'passes through it than the {self.expected} micro batches this step expects')
    if bucket in self.flying:            # the last pass's reduction: folded before the bucket fills again
      self._fold(bucket)
    if bucket.data is None:
      spare = self.spare.setdefault(bucket.dtype, [])
      flat = spare.pop() if spare else torch.empty(self.largest[bucket.dtype], dtype=bucket.dtype, device=bucket.device)
      bucket.data = flat[:bucket.parts * bucket.size].view(bucket.parts, bucket.size).zero_()
      bucket.flat = flat
      self.targets.update({n: self._targets(n) for n in bucket.names})
    rows = grad.reshape(grad.shape[0], -1)
    for destination, lo, hi in self.targets[name]:
      destination.add_(rows if (lo, hi) == (0, rows.shape[0]) else rows[lo:hi])
    self.counts[name] += 1
    if not self.queued and torch._C._current_graph_task_id() != -1:    # pylint: disable=protected-access
      self.queued = True               # inside a backward: the pass's leftovers are reduced at its end
      torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)  # pylint: disable=protected-access
    if self.overlap and all(self.counts[n] > bucket.passes for n in bucket.names):
      self._reduce(bucket)

  def _reduce(self, bucket):
    """Start `bucket`'s reduction (in flight where the buffer overlaps, else done at once)."""
    bucket.passes += 1
    name = f'{self.collective}(grads over dp, ZeRO-2, bucket {self.buckets.index(bucket)})'
    if self.collective == 'all_reduce':
      work = comm.all_reduce_(bucket.data, self.group, name=name, async_op=self.overlap)
    elif dist.get_backend(self.group) == 'gloo':
      for b in list(self.flying):        # one point-to-point reduction at a time: one receive buffer
        self._fold(b)
      work = grad_reduce.PointToPoint(bucket.data, self.index, self.group,
                                      grad_reduce.TAGS + self.buckets.index(bucket))
    else:
      bucket.mine = torch.empty(bucket.size, dtype=bucket.dtype, device=bucket.device)
      work = comm.reduce_scatter_into(bucket.mine, bucket.data.view(-1), self.group, name=name,
                                      async_op=self.overlap)
    bucket.work = work if isinstance(work, grad_reduce.PointToPoint) or self.overlap else None
    self.flying.append(bucket)
    if bucket.work is None:              # done already (no overlap: XLA, or overlap_grad_reduce off)
      self._fold(bucket)
    while len(self.flying) > IN_FLIGHT:
      self._fold(self.flying[0])

  def _fold(self, bucket):
    """Wait for `bucket`'s reduction, add this rank's part into `owned`, free the whole buffer."""
    comm.wait(bucket.work, f'{self.collective}(grads over dp, ZeRO-2)', self.group)
    bucket.owned.add_(bucket.mine if bucket.mine is not None else bucket.data[self.index])
    self.spare[bucket.dtype].append(bucket.flat)
    bucket.data = bucket.mine = bucket.work = bucket.flat = None
    for n in bucket.names:             # their views held the buffer
      self.targets.pop(n, None)
    self.flying.remove(bucket)

  def _end_of_pass(self):
    """Reduce what the pass filled and did not complete (a parameter it did not reach), and fold all."""
    self.queued = False
    for b in self.buckets:
      if b.data is not None and b not in self.flying:
        self._reduce(b)
    for b in list(self.flying):
      self._fold(b)

  def start(self, backwards):
    super().start(backwards)
    for b in self.buckets:
      b.owned.zero_()
      b.passes = 0

  def reduced(self):
    """name -> this rank's owned rows of the gradient summed over DP and the step's passes
    (views of the buckets' `owned`)."""
    self._end_of_pass()                  # gradients added outside a backward are reduced here
    self.counts = dict.fromkeys(self.counts, 0)
    self.expected = None
    out = {}
    for n, (offset, size, per) in self.layout.items():
      p = self.params[n]
      rows, _ = zero.shard_rows(p.shape[0], self.parts, self.index)
      owned = self.buckets[self.bucket_of[n]].owned[offset:offset + size].view(per, -1)
      out[n] = owned[:rows.stop - rows.start].view((rows.stop - rows.start,) + p.shape[1:])
    return out

  def owned_parts(self):
    return [b.owned for b in self.buckets]

  def bytes(self):
    """The owned accumulators and the whole buffers kept for reuse."""
    kept = [t for spare in self.spare.values() for t in spare]
    return sum(t.numel() * t.element_size() for t in [b.owned for b in self.buckets] + kept)
