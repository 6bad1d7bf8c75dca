"""Every collective flatron uses, and the autograd pairs Megatron's TP/SP are built from.

A `group` of None means "a group of one": the op is the identity. Collectives that fail or
time out (distributed_strategy.collective_timeout_s) are re-raised naming this rank and
the operation, so a hang reads "rank 3: all_reduce(tp) timed out", not a bare gloo error.

Conjugate pairs (forward / backward):
  copy_to_group      identity   / all-reduce      (Megatron's f: entering a TP region)
  reduce_from_group  all-reduce / identity        (Megatron's g: leaving it)
  gather_seq         all-gather / reduce-scatter  (SP: entering a TP region)
  reduce_scatter_seq reduce-scatter / all-gather  (SP: leaving it)
  split_seq          keep own shard / all-gather  (SP: where the sequence is first sharded)
  all_to_all         rows to each rank / the reverse all-to-all (MoE expert parallelism)
"""
import torch
import torch.distributed as dist

import user_errors
from user_errors import UserError

# torch 2.13 renamed the flat-tensor collectives; torch 2.9 (torch-xla's pin) has only the old names.
_all_gather_flat = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor


class CollectiveError(UserError, RuntimeError):
  """A collective that failed or timed out on this rank: a peer stopped, died or lost its network."""


def _run(name, group, fn):
  try:
    return fn()
  except RuntimeError as e:
    raise CollectiveError(
        f'rank {dist.get_rank()}: {name} over ranks {dist.get_process_group_ranks(group)} failed: '
        f'{user_errors.shorten(str(e).splitlines()[0] if str(e) else repr(e))}; another rank stopped, died or lost '
        'its network (see its log), or it is slower than distributed_strategy.collective_timeout_s allows') from e


def group_size(group):
  return 1 if group is None else dist.get_world_size(group)


def group_rank(group):
  return 0 if group is None else dist.get_rank(group)


def all_reduce_(x, group, op=dist.ReduceOp.SUM, name='all_reduce', async_op=False):
  """In-place all-reduce; identity for a group of one. With `async_op` returns the work to
  `wait` on (None for a group of one)."""
  if group is None:
    return None if async_op else x
  work = _run(name, group, lambda: dist.all_reduce(x, op=op, group=group, async_op=async_op))
  return work if async_op else x


def reduce_scatter_into(out, x, group, name='reduce_scatter', async_op=False):
  """Sum flat `x` over `group` and leave this rank's 1/n of it in `out` (the work if `async_op`)."""
  return _run(name, group, lambda: _reduce_scatter_flat(out, x, group=group, async_op=async_op))


def all_gather_into(out, x, group, name='all_gather'):
  """Every rank's flat `x`, in rank order, into flat `out`."""
  _run(name, group, lambda: _all_gather_flat(out, x, group=group))
  return out


def wait(work, name, group):
  """Wait for an async collective, naming it and this rank if it failed or timed out."""
  if work is not None:
    _run(name, group, work.wait)


def all_gather(x, group, dim, name='all_gather'):
  if group is None:
    return x
  if dim != 0:
    # contiguous: a transposed view would make every consumer (each column linear) save its own copy
    return all_gather(x.movedim(dim, 0).contiguous(), group, 0, name).movedim(0, dim).contiguous()
  n = dist.get_world_size(group)
  out = torch.empty((n * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
  _run(name, group, lambda: _all_gather_flat(out, x.contiguous(), group=group))
  return out


def reduce_scatter(x, group, dim, name='reduce_scatter'):
  if group is None:
    return x
  if dim != 0:
    return reduce_scatter(x.movedim(dim, 0).contiguous(), group, 0, name).movedim(0, dim)
  n = dist.get_world_size(group)
  out = torch.empty((x.shape[0] // n,) + x.shape[1:], dtype=x.dtype, device=x.device)
  _run(name, group, lambda: _reduce_scatter_flat(out, x.contiguous(), group=group))
  return out


def buckets(names, sizes, limit):
  """`names` in order, cut into consecutive lists whose `sizes` (bytes) reach `limit`."""
  bucket, total = [], 0
  for name in names:
    bucket.append(name)
    total += sizes[name]
    if total >= limit:
      yield bucket
      bucket, total = [], 0
  if bucket:
    yield bucket


class PeerError(UserError, RuntimeError):
  """Raised on the ranks that did not fail themselves when another rank's step failed."""


def failed_ranks(failed: bool, group) -> list:
  """The ranks (of `group`, CPU/gloo) on which `failed` is true; a barrier too."""
  if group is None:
    return [0] if failed else []
  flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
  flags[dist.get_rank(group)] = int(failed)
  all_reduce_(flags, group, name='all_reduce(failure flags)')
  return [dist.get_global_rank(group, i) for i in flags.nonzero().flatten().tolist()]


def on_every_rank(fn, group, what):
  """fn() on every rank; if it raised anywhere, every rank raises (its own error, or one that
  names the ranks that failed), so no rank is left waiting in a later collective."""
  try:
    result, error = fn(), None
  except Exception as e:  # pylint: disable=broad-except  (re-raised below, on every rank)
    result, error = None, e
  failed = failed_ranks(error is not None, group)
  if error is not None:
    raise error
  if failed:
    raise PeerError(f'{what} failed on rank(s) {failed}; see the error printed there')
  return result


def own_chunk(x, group, dim):
  if group is None:
    return x
  # clone, not contiguous: a view (the b = 1 case) would keep the whole tensor alive
  return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].clone()


def _conjugate_pair(forward, backward):
  """An autograd function f(x, group, dim) running `forward` and, on the gradient, `backward`
  (each a function of (tensor, group, dim))."""

  class Pair(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, dim):  # pylint: disable=arguments-differ
      ctx.group, ctx.dim = group, dim
      return forward(x, group, dim)

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
      return backward(grad, ctx.group, ctx.dim), None, None

  return Pair.apply


_copy_to_group = _conjugate_pair(
    lambda x, group, dim: x.view_as(x),
    lambda g, group, dim: all_reduce_(g.contiguous(), group, name='all_reduce(grad of TP input)'))
_reduce_from_group = _conjugate_pair(
    lambda x, group, dim: all_reduce_(x.clone(), group, name='all_reduce(TP output)'),
    lambda g, group, dim: g)
_gather_seq = _conjugate_pair(
    lambda x, group, dim: all_gather(x, group, dim, name='all_gather(SP sequence)'),
    lambda g, group, dim: reduce_scatter(g, group, dim, name='reduce_scatter(grad of SP gather)'))
_reduce_scatter_seq = _conjugate_pair(
    lambda x, group, dim: reduce_scatter(x, group, dim, name='reduce_scatter(SP output)'),
    lambda g, group, dim: all_gather(g, group, dim, name='all_gather(grad of SP reduce-scatter)'))
_sum_over_group = _conjugate_pair(     # a sum every member uses: each one's gradient of it is a part
    lambda x, group, dim: all_reduce_(x.clone(), group, name='all_reduce(partial sums over tp)'),
    lambda g, group, dim: all_reduce_(g.contiguous(), group, name='all_reduce(grad of partial sums over tp)'))
_split_seq = _conjugate_pair(
    own_chunk,
    lambda g, group, dim: all_gather(g, group, dim, name='all_gather(grad of SP split)'))


def copy_to_group(x, group):
  return x if group is None else _copy_to_group(x, group, 0)


def reduce_from_group(x, group):
  return x if group is None else _reduce_from_group(x, group, 0)


def sum_over_group(x, group):
  """The sum of every member's `x`, on every member; its gradient is the sum of theirs."""
  return x if group is None else _sum_over_group(x, group, 0)


def gather_seq(x, group, dim=1):
  return x if group is None else _gather_seq(x, group, dim)


def reduce_scatter_seq(x, group, dim=1):
  return x if group is None else _reduce_scatter_seq(x, group, dim)


def split_seq(x, group, dim=1):
  return x if group is None else _split_seq(x, group, dim)


def all_to_all_single(out, x, out_splits, in_splits, group, name='all_to_all'):
  """Rows of `x`: in_splits[i] of them to rank i; `out` gets out_splits[i] rows from rank i."""
  _run(name, group, lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group))
  return out


class _AllToAll(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x, group, send, recv, name):  # pylint: disable=arguments-differ
    ctx.group, ctx.send, ctx.recv, ctx.name = group, send, recv, name
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), recv, send, group, name)

  @staticmethod
  def backward(ctx, grad):  # pylint: disable=arguments-differ
    out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
    return all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group,
                             f'grad of {ctx.name}'), None, None, None, None


def all_to_all(x, group, send, recv, name='all_to_all'):
  """Differentiable all-to-all of rows: send[i] rows of `x` (in order) to rank i, recv[i]
  rows received from rank i, concatenated in rank order; the gradient goes back the same way."""
  return x if group is None else _AllToAll.apply(x, group, list(send), list(recv), name)
