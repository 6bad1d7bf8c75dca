"""Ring attention: causal attention over a sequence held in slices by the `cp` ranks.

Each rank keeps its queries; the key/value blocks travel once around the ring (each rank
sends the block it holds to the next and receives the previous rank's, the transfer of the
next block overlapping the compute on the current one). The partial results are merged by
their log-sum-exp (the online softmax), so the output is exact, not approximated. The
backward sends the K/V blocks around again, each with the dK/dV accumulated for it so far;
after a full turn every block's gradient is back with its owner.

Which (query piece, key piece) blocks run, and with which mask: parallel/ring_blocks.py.

The communication is a `ring` value (`size`, `rank`, `start(tensor, tag) -> handle` whose
`wait()` returns the previous rank's tensor): `GroupRing` is point-to-point over a process
group; tests/test_ring_attention.py runs the same function on threads (`ThreadRing`).
Keys and values travel as one block, concatenated on the head dim, so values may be narrower
than keys (latent attention's v_head_dim). Sinks (gpt-oss) are a key every query sees whose
value is zero: each query's running log-sum-exp starts at its head's sink logit instead of
-inf, and the sink's gradient is -sum p_sink rowsum(dO * O), its probability's share of the
softmax Jacobian.

Everything inside runs in fp32 (fp64 inputs: fp64); outputs and gradients come back in the inputs' dtypes.
"""
import queue

import torch
import torch.distributed as dist

from parallel import ring_blocks

KV, DKV = 0, 1      # message tags: blocks and their gradients travel at the same time


class GroupRing:
  """Point-to-point sends to the next rank of a process group, receives from the previous."""

  def __init__(self, group):
    self.group = group
    self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
    self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
    self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

  def start(self, x, tag):
    x = x.contiguous()
    out = torch.empty_like(x)
    works = [dist.isend(x, self.next, group=self.group, tag=tag), dist.irecv(out, self.prev, group=self.group, tag=tag)]
    return _Pending(works, out, x, f'ring attention exchange {tag} (from rank {self.prev}, to rank {self.next})')


class _Pending:

  def __init__(self, works, out, sent, what=None):
    self.works, self.out, self.sent, self.what = works, out, sent, what   # `sent` alive until the send is done

  def wait(self):
    try:
      for work in self.works:
        work.wait()
    except RuntimeError as e:            # a peer that stopped: name this rank and the exchange
      raise RuntimeError(f'rank {dist.get_rank()}: {self.what} failed: {str(e).splitlines()[0]}') from e
    return self.out


class ThreadRing:
  """The ring of `size` ranks emulated by threads of one process (tests): one mailbox per
  rank and tag, each rank's view a `ThreadRing.Member`."""

  def __init__(self, size):
    self.size = size
    self.boxes = [[queue.Queue() for _ in (KV, DKV)] for _ in range(size)]

  def member(self, rank):
    return ThreadRing.Member(self, rank)

  class Member:

    def __init__(self, ring, rank):
      self.ring, self.size, self.rank = ring, ring.size, rank

    def start(self, x, tag):
      self.ring.boxes[(self.rank + 1) % self.size][tag].put(x.clone())
      return _Mailbox(self.ring.boxes[self.rank][tag])


class _Mailbox:

  def __init__(self, box):
    self.box = box

  def wait(self):
    return self.box.get(timeout=60)


def _scores(q, k, mask, scale):
  # in place: a block's scores are the one temporary of its size (the allocator's churn, and
  # with it CPU time and peak RSS, follows the count of such temporaries)
  scores = (q @ k.transpose(-1, -2)).mul_(scale)
  return scores if mask is None else scores.masked_fill_(~mask, float('-inf'))


def _finite(lse):
  """lse with -inf (a row that saw no key yet) as 0, so exp(s - lse) is 0 there, not nan."""
  return torch.nan_to_num(lse, nan=float('nan'), posinf=0.0, neginf=0.0)   # one operation, not isinf, zeros, where


def _grouped(q, g):
  """[b, n, s, d] -> [b, g, n/g, s, d]: query head h reads KV head h // (n/g), as HF's repeat."""
  b, n, s, d = q.shape
  return q.view(b, g, n // g, s, d)


def _start_lse(sinks, g, like, dt):
  """The running log-sum-exp before any key [b, g, n/g, s]: -inf, or each head's sink logit."""
  shape = like.shape[:-1]
  if sinks is None:
    return torch.full(shape, float('-inf'), dtype=dt, device=like.device)
  return sinks.to(dt).view(1, g, -1, 1).expand(shape).clone()


def _forward(q, k, v, sinks, ring, index_by_rank, seg_by_rank, reach, scale, chunks):
  g, dk = k.shape[1], k.shape[-1]
  dt = torch.promote_types(q.dtype, torch.float32)
  q5 = _grouped(q.to(dt), g).chunk(chunks, 3)
  out = [p.new_zeros(*p.shape[:-1], v.shape[-1]) for p in q5]
  lse = [_start_lse(sinks, g, p, dt) for p in q5]
  kv = torch.cat([k, v], -1)
  for step in range(ring.size):
    src = (ring.rank - step) % ring.size
    pending = ring.start(kv, KV) if step < ring.size - 1 else None
    k5, v5 = (t.to(dt)[:, :, None].chunk(chunks, 3) for t in kv.split([dk, kv.shape[-1] - dk], -1))
    for a, c, mask in ring_blocks.pairs(ring, src, index_by_rank, seg_by_rank, reach, chunks, q):
      probs = _scores(q5[a], k5[c], mask, scale)
      top = probs.amax(-1)                                  # -inf on rows this block hides entirely
      shift = _finite(top)
      probs = probs.sub_(shift[..., None]).exp_()          # unnormalized: exp(s - top)
      new = torch.logaddexp(lse[a], shift + probs.sum(-1).log())    # with the block's lse
      # out = e^(lse - new) out + e^(block_lse - new) probs v / sum(probs), and the block's
      # weight is e^(top - new): 0, not nan, where the block hides the row (top = -inf)
      new_shift = _finite(new)
      out[a] = torch.exp(lse[a] - new_shift)[..., None] * out[a] + \
          torch.exp(top - new_shift)[..., None] * (probs @ v5[c])
      lse[a] = new
    if pending is not None:
      kv = pending.wait()
  return torch.cat(out, 3), torch.cat(lse, 3)


def _backward(grad_out, q, k, v, sinks, out, lse, ring, index_by_rank, seg_by_rank, reach, scale, chunks):
  g, dk = k.shape[1], k.shape[-1]
  dt = torch.promote_types(q.dtype, torch.float32)
  q5 = _grouped(q.to(dt), g)
  do5 = _grouped(grad_out.to(dt), g)
  delta = (do5 * _grouped(out.to(dt), g)).sum(-1)    # rowsum(dO * O): the softmax's Jacobian term
  lse = _finite(lse)
  dsinks = None
  if sinks is not None:       # the sink's probability times its Jacobian term (its value is 0)
    dsinks = -(torch.exp(sinks.to(dt).view(1, g, -1, 1) - lse) * delta).sum((0, 3)).reshape(-1)
  q5, do5, lse, delta = q5.chunk(chunks, 3), do5.chunk(chunks, 3), lse.chunk(chunks, 3), delta.chunk(chunks, 3)
  dq = [torch.zeros_like(p) for p in q5]
  kv, arriving = torch.cat([k, v], -1), None
  for step in range(ring.size):
    src = (ring.rank - step) % ring.size
    pending = ring.start(kv, KV) if step < ring.size - 1 else None
    k5, v5 = (t.to(dt)[:, :, None].chunk(chunks, 3) for t in kv.split([dk, kv.shape[-1] - dk], -1))
    dk_ = [torch.zeros_like(p[:, :, 0]) for p in k5]
    dv = [torch.zeros_like(p[:, :, 0]) for p in v5]
    for a, c, mask in ring_blocks.pairs(ring, src, index_by_rank, seg_by_rank, reach, chunks, q):
      probs = _scores(q5[a], k5[c], mask, scale).sub_(lse[a][..., None]).exp_()
      dv[c] = dv[c] + (probs.transpose(-1, -2) @ do5[a]).sum(2)
      dscores = (do5[a] @ v5[c].transpose(-1, -2)).sub_(delta[a][..., None]).mul_(probs)
      dq[a] = dq[a] + (dscores @ k5[c]) * scale
      dk_[c] = dk_[c] + (dscores.transpose(-1, -2) @ q5[a]).sum(2) * scale
    dkv = torch.cat([torch.cat(dk_, 2), torch.cat(dv, 2)], -1)
    if arriving is not None:                  # what the ranks before added for this block
      dkv = arriving.wait() + dkv
    arriving = ring.start(dkv, DKV)           # the last send hands each block's total to its owner
    if pending is not None:
      kv = pending.wait()
  dkv = arriving.wait()
  b, n, s, d = q.shape
  return torch.cat(dq, 3).reshape(b, n, s, d), dkv[..., :dk], dkv[..., dk:], dsinks


class _RingAttention(torch.autograd.Function):

  @staticmethod
  def forward(ctx, q, k, v, sinks, ring, index_by_rank, seg_by_rank, reach, scale, chunks):  # pylint: disable=arguments-differ
    out, lse = _forward(q, k, v, sinks, ring, index_by_rank, seg_by_rank, reach, scale, chunks)
    b, n, s, _ = q.shape
    out = out.reshape(b, n, s, v.shape[-1]).to(q.dtype)
    # the output as returned (in the inputs' dtype, as flash attention keeps it): no fp32 copy
    ctx.save_for_backward(q, k, v, sinks, out, lse)
    ctx.args = ring, index_by_rank, seg_by_rank, reach, scale, chunks
    return out

  @staticmethod
  def backward(ctx, grad_out):  # pylint: disable=arguments-differ
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv, dsinks = _backward(grad_out, q, k, v, sinks, out, lse, *ctx.args)
    dsinks = dsinks.to(sinks.dtype) if dsinks is not None else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None, None


def ring_attention(q_bnsd, k_bgsd, v_bgsd, ring, index_by_rank, seg_by_rank=None, window=0, scale=None, chunks=2,
                   sinks_n=None, chunk=0):
  """softmax(q k^T scale) v for this rank's queries against every rank's keys (GQA: g KV heads
  for n query heads; v's head dim may differ from q's and k's). `index_by_rank` [cp, s]: each
  rank's global sequence indices; `seg_by_rank` [cp, b, s]: their document ids (packed rows) or
  None; `window`: HF's sliding window (0 = none); `chunks`: pieces of a slice that are skipped
  separately when masked out; `sinks_n` [n]: each query head's sink logit (gpt-oss) or None;
  `chunk`: Llama 4's attention chunk size (0 = none)."""
  scale = q_bnsd.shape[-1] ** -0.5 if scale is None else scale
  return _RingAttention.apply(q_bnsd, k_bgsd, v_bgsd, sinks_n, ring, index_by_rank, seg_by_rank,
                              ring_blocks.Reach(window, chunk), scale, chunks)
