"""Gradient buckets: the trainable parameters' gradients accumulate into flat buffers, and each
bucket's data-parallel reduction starts as soon as the backward has finished with it.

Megatron's DDP and distributed optimizer do it this way: no parameter keeps a `.grad` between
micro batches (a post-accumulate hook adds it into its bucket and frees it), so a rank holds
one full-size copy of its gradients (in the recipe's accumulation dtype) plus one parameter's
transient gradient. A bucket is about `bucket_size_collectives` MiB of parameters, in reverse
order of their use, so the backward fills the first bucket first.

Layout, for ZeRO-1's `parts` (= DP ranks; 1 without ZeRO-1): each parameter's rows are padded
to parts x per and the bucket is a [parts, S] array whose row k holds, parameter after
parameter, the rows part k owns. Part k of a bucket is then one contiguous range: ZeRO-1's
reduce-scatter hands it to rank k as it is, and the owned rows of every parameter are views
of it (the optimizer steps on them; nothing is copied out).

Reduction over `group` (DP), per bucket, in place:
  no ZeRO-1                 all-reduce
  ZeRO-1, 'reduce_scatter'  reduce-scatter, own part copied back into the bucket; on gloo
                            point to point: part k sent to rank k, the others' parts of
                            this rank's received and added into it in rank order
  ZeRO-1, 'all_reduce'      all-reduce of the whole bucket, own part read from it
Both ZeRO-1 choices give the same sums (bitwise at two ranks, where each element is one
addition a + b either way). `auto` is the reduce-scatter: it moves half the bytes of the
all-reduce (measured on gloo, 2 ranks, 828 MB in 32 MiB buckets: 0.32 s against 0.54 s;
docs/performance.md). On gloo at most one bucket's point-to-point reduction is in flight, so
its receive buffer is one bucket's (parts - 1) / parts.

Overlap: after `start(backwards)`, a parameter is complete once its hook has run that many
times (one backward per micro batch through its pipeline chunk); a bucket whose parameters
are all complete launches its collective asynchronously, in bucket order. `reduced()` waits,
launching any bucket the backward did not complete (a parameter without a gradient in a step
contributes zeros). Overlap on or off runs the same collectives on the same buffers, so the
results are bitwise equal; only when they run differs.
"""
import torch
import torch.distributed as dist

from parallel import comm, grad_reduce, zero

class Bucket:
  """One flat [parts, size] buffer and where each of its parameters sits in it."""

  def __init__(self, names, layout, parts, dtype, device, allocate=True):
    self.names, self.size = names, sum(layout[n][1] for n in names)
    self.parts, self.dtype, self.device = parts, dtype, device
    self.data = torch.zeros(parts, self.size, dtype=dtype, device=device) if allocate else None
    self.work = self.mine = None        # the collective in flight; reduce-scatter's output


class GradBuffer:

  WHOLE_BUCKETS = True          # every bucket's [parts, S] buffer lives from start to end (ZeRO-2's do not)

  def __init__(self, params, names, dtype, parts, index, group, bucket_bytes, collective, overlap=True):
    """Buckets for `params[n]` for n in `names` (in forward order), accumulating in `dtype` (or
    the parameter's own, if wider); hooks on those parameters add each backward's gradient in."""
    self.params, self.parts, self.index, self.group = params, parts, index, group
    self.collective = grad_reduce.resolved(collective) if parts > 1 else 'all_reduce'
    self.overlap = overlap and group is not None and next(iter(params.values())).device.type != 'xla'
    self.layout = {}             # name -> (offset in its bucket's part, elements per part, rows per part)
    for n in names:
      p = params[n]
      _, per = zero.shard_rows(p.shape[0], parts, index)
      self.layout[n] = (0, per * zero.row_size(p), per)
    # A parameter wider than the accumulation dtype (LoRA's fp32 adapters under bf16SR) keeps its
    # own: buckets hold one dtype each.
    dtypes = {n: torch.promote_types(dtype, params[n].dtype) for n in names}
    self.buckets, self.bucket_of = [], {}
    for bucket_dtype in dict.fromkeys(dtypes[n] for n in reversed(names)):
      order = [n for n in reversed(names) if dtypes[n] == bucket_dtype]
      sizes = {n: self.layout[n][1] * parts * torch.finfo(bucket_dtype).bits // 8 for n in order}
      for names_in in comm.buckets(order, sizes, bucket_bytes):
        offset = 0
        for n in names_in:
          self.layout[n] = (offset,) + self.layout[n][1:]
          offset += self.layout[n][1]
          self.bucket_of[n] = len(self.buckets)
        self.buckets.append(Bucket(names_in, self.layout, parts, bucket_dtype, params[names_in[0]].device,
                                   allocate=self.WHOLE_BUCKETS))
    self.counts = dict.fromkeys(names, 0)
    self.expected, self.launched = None, 0
    # name -> [(destination rows in part k's view, source rows lo, hi)], made once: the hook runs
    # per parameter and micro batch, and slicing anew there was most of its host time
    self.targets = {n: self._targets(n) for n in names} if self.WHOLE_BUCKETS else {}
    for n in names:
      params[n].register_post_accumulate_grad_hook(self._hook(n))

  def _targets(self, name):
    rows, out = self.params[name].shape[0], []
    for k in range(self.parts):
      view = self._part_view(name, k)
      lo = min(k * view.shape[0], rows)
      hi = min(lo + view.shape[0], rows)
      out.append((view[:hi - lo], lo, hi))
    return out

  def _hook(self, name):
    def hook(p):
      self.accumulate(name, p.grad)
      p.grad = None
    return hook

  def _part_view(self, name, k):
    """Part k's rows of `name` in its bucket: [per, row size]."""
    offset, size, per = self.layout[name]
    return self.buckets[self.bucket_of[name]].data[k, offset:offset + size].view(per, -1)

  def accumulate(self, name, grad):
    """Add one backward's gradient of `name` (the whole box) into its bucket."""
    bucket = self.buckets[self.bucket_of[name]]
    if bucket.work is not None or self.bucket_of[name] < self.launched:
      raise RuntimeError(f'a gradient of {name} arrived after its bucket was reduced: more backward '
                         f'passes through it than the {self.expected} micro batches this step expects')
    rows = grad.reshape(grad.shape[0], -1)
    first = self.counts[name] == 0
    for destination, lo, hi in self.targets[name]:
      source = rows if (lo, hi) == (0, rows.shape[0]) else rows[lo:hi]
      if first:
        destination.copy_(source)
      else:
        destination.add_(source)
    self.counts[name] += 1
    if self.overlap and self.expected is not None and self.counts[name] == self.expected:
      self._launch_ready()

  def start(self, backwards):
    """A new step of `backwards` backward passes per parameter (its micro batches)."""
    self.counts = dict.fromkeys(self.counts, 0)
    self.expected, self.launched = backwards, 0

  def _launch_ready(self):
    while self.launched < len(self.buckets) and all(
        self.counts[n] == self.expected for n in self.buckets[self.launched].names):
      self._launch(self.buckets[self.launched], async_op=True)

  def _launch(self, bucket, async_op):
    self.launched += 1
    if self.group is None:
      return
    name = f'{self.collective}(grads over dp, bucket {self.launched - 1})'
    if self.collective == 'all_reduce':
      work = comm.all_reduce_(bucket.data, self.group, name=name, async_op=async_op)
    elif dist.get_backend(self.group) == 'gloo':
      if self.launched > 1:                  # one receive buffer at a time: the previous bucket's done
        previous = self.buckets[self.launched - 2]
        comm.wait(previous.work, name, self.group)
        previous.work = None
      work = grad_reduce.PointToPoint(bucket.data, self.index, self.group, grad_reduce.TAGS + self.launched)
      if not async_op:
        comm.wait(work, name, self.group)
    else:
      bucket.mine = torch.empty(bucket.size, dtype=bucket.data.dtype, device=bucket.data.device)
      work = comm.reduce_scatter_into(bucket.mine, bucket.data.view(-1), self.group, name=name, async_op=async_op)
    bucket.work = work if async_op else None

  def reduced(self):
    """name -> this rank's owned rows of the gradient summed over DP ([owned rows, ...] views of
    the buckets), once every bucket's collective is done."""
    for n, count in self.counts.items():
      if count == 0:                       # no gradient this step: zeros, on every rank alike
        for k in range(self.parts):
          self._part_view(n, k).zero_()
    while self.launched < len(self.buckets):
      self._launch(self.buckets[self.launched], async_op=False)
    for bucket in self.buckets:
      comm.wait(bucket.work, f'{self.collective}(grads over dp)', self.group)
      bucket.work = None
      if bucket.mine is not None:
        bucket.data[self.index].copy_(bucket.mine)
        bucket.mine = None
    self.counts = dict.fromkeys(self.counts, 0)
    self.expected, self.launched = None, 0
    out = {}
    for n in self.layout:
      p = self.params[n]
      rows, _ = zero.shard_rows(p.shape[0], self.parts, self.index)
      out[n] = self._part_view(n, self.index)[:rows.stop - rows.start].view((rows.stop - rows.start,) + p.shape[1:])
    return out

  def owned_parts(self):
    """This rank's part of each bucket, reduced ([S] views)."""
    return [b.data[self.index] for b in self.buckets]

  def bytes(self):
    return sum(b.data.numel() * b.data.element_size() for b in self.buckets)



class Domains:
  """The GradBuffers of each reduction domain (parallel/experts.py: dense parameters over
  DP; MoE experts under expert parallelism over the DP ranks holding the same experts)."""

  def __init__(self, buffers):
    self.buffers = buffers
    self.of = {n: b for b in buffers for n in b.layout}

  def accumulate(self, name, grad):
    self.of[name].accumulate(name, grad)

  def start(self, backwards):
    for b in self.buffers:
      b.start(backwards)

  def reduced(self):
    out = {}
    for b in self.buffers:
      out.update(b.reduced())
    return out

  def bytes(self):
    return sum(b.bytes() for b in self.buffers)

  @property
  def buckets(self):
    return [bucket for b in self.buffers for bucket in b.buckets]

  def __getattr__(self, name):        # one domain (no expert parallelism): the GradBuffer's own
    buffers = self.__dict__.get('buffers', ())
    if len(buffers) == 1:
      return getattr(buffers[0], name)
    raise AttributeError(name)
