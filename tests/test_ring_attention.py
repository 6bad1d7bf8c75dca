"""Ring attention on one process (the ring emulated by threads) against SDPA over the whole
sequence: outputs and gradients of q, k, v in fp32, within fp32's round-off of SDPA in fp64."""
import threading

import pytest
import torch
import torch.nn.functional as F


from model import attention
from parallel import ring_attention as ra, ring_blocks as rb
from tests import parity


def _on_ring(cp, fn):
  """fn(rank, ring member) on `cp` threads; their results in rank order."""
  ring, results, errors = ra.ThreadRing(cp), [None] * cp, []

  def run(r):
    try:
      results[r] = fn(r, ring.member(r))
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  if errors:
    raise errors[0]
  return results


def _reference(q, k, v, mask, scale, sinks):
  """softmax over the allowed keys (and each head's sink, a key of value zero) times v, GQA."""
  groups = q.shape[1] // k.shape[1]
  k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
  scores = (q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)).masked_fill(~mask, float('-inf'))
  if sinks is not None:
    scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
  probs = torch.softmax(scores, -1)
  return probs[..., :k.shape[2]] @ v


def _compare(cp, segments=None, window=0, heads=4, kv_heads=2, s=32, b=2, d=8, scale=None, dtype=torch.float32,
             dv=None, sinks=False, chunk=0):
  g = torch.Generator().manual_seed(cp * 100 + window)
  q = torch.randn(b, heads, s, d, generator=g, dtype=dtype, requires_grad=True)
  k = torch.randn(b, kv_heads, s, d, generator=g, dtype=dtype, requires_grad=True)
  v = torch.randn(b, kv_heads, s, dv or d, generator=g, dtype=dtype, requires_grad=True)
  inputs = [q, k, v] + ([torch.randn(heads, generator=g, dtype=dtype, requires_grad=True)] if sinks else [])
  dout = torch.randn(b, heads, s, dv or d, generator=g, dtype=dtype)
  mask = attention.attention_mask(segments, s, window, chunk=chunk)
  if mask is None:
    mask = attention.causal_mask_after(0, s)
  # the reference in fp64: fp32 SDPA's own rounding is of the order of the tolerance
  wide = [t.detach().double().requires_grad_() for t in inputs]
  if sinks or dv:
    ref = _reference(*wide[:3], mask, scale, wide[3] if sinks else None)
  else:
    ref = F.scaled_dot_product_attention(*wide, attn_mask=mask, scale=scale, enable_gqa=True)
  ref_grads = [x.to(dtype) for x in torch.autograd.grad(ref, wide, dout.double())]
  ref = ref.to(dtype)
  index = rb.layout_indices(s, cp)
  seg_by_rank = segments[:, index].transpose(0, 1) if segments is not None else None

  def rank(r, ring):
    local = [t.detach()[:, :, index[r]].clone().requires_grad_() for t in (q, k, v)]
    sink = [inputs[3].detach().clone().requires_grad_()] if sinks else []
    out = ra.ring_attention(*local, ring, index, seg_by_rank, window, scale, sinks_n=sink[0] if sinks else None,
                            chunk=chunk)
    return out.detach(), torch.autograd.grad(out, local + sink, dout[:, :, index[r]])

  results = _on_ring(cp, rank)
  out = torch.empty_like(ref)
  grads = [torch.empty_like(t) for t in (q, k, v)] + ([torch.zeros_like(inputs[3])] if sinks else [])
  for r, (o, gs) in enumerate(results):
    out[:, :, index[r]] = o
    for whole, part in zip(grads, gs):
      if whole.dim() == 4:
        whole[:, :, index[r]] = part
      else:                    # the sinks' gradient: each rank's queries' share, summed
        whole += part
  # fp32 round-off: scores add d products, the softmax and the output s keys, dk and dv s
  # queries of each of the heads that share a kv head (a sink: b s queries)
  terms = d + s + s * heads // kv_heads + (b * s if sinks else 0)
  parity.assert_close_roundoff(out, ref.detach(), terms)
  for name, got, want in zip(['q', 'k', 'v', 'sinks'], grads, ref_grads):
    parity.assert_close_roundoff(got, want, terms, msg=lambda m, n=name: f'd{n}: {m}')


@pytest.mark.parametrize('cp', [1, 2, 4])
def test_causal_gqa_matches_sdpa(cp):
  _compare(cp)


def test_multi_query_and_scale():
  _compare(2, heads=4, kv_heads=1, scale=0.3)


@pytest.mark.parametrize('cp', [2, 4])
def test_packed_documents_across_chunk_boundaries(cp):
  # documents of 5, 11, 1, 9, 6 tokens in one row and 16, 16 in the other: boundaries fall
  # inside chunks and across ranks
  lengths = [[5, 11, 1, 9, 6], [16, 16]]
  segments = torch.stack([torch.repeat_interleave(torch.arange(len(l)), torch.tensor(l)) for l in lengths])
  _compare(cp, segments=segments)


@pytest.mark.parametrize('window', [3, 5, 12])
def test_sliding_window(window):
  _compare(4, window=window)


@pytest.mark.parametrize('cp', [1, 2, 4])
def test_values_narrower_than_keys(cp):
  """Latent attention (DeepSeek-V3): q and k of nope + rope dims, v of v_head_dim."""
  _compare(cp, heads=4, kv_heads=4, d=12, dv=8, scale=0.2)


@pytest.mark.parametrize('cp', [1, 2, 4])
def test_sinks_and_their_gradient(cp):
  """gpt-oss: a sink logit per head in every query's softmax, with a sliding window too."""
  _compare(cp, sinks=True)
  _compare(cp, sinks=True, window=5)


@pytest.mark.parametrize('chunk', [4, 6, 16])
def test_chunked_attention(chunk):
  """Llama 4: each query sees the keys of its own chunk of positions; chunks cross the ranks' slices."""
  _compare(4, chunk=chunk)


def test_chunks_with_documents():
  segments = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 13, 12]))[None].expand(2, -1)
  _compare(2, segments=segments, chunk=10)


def test_window_with_documents():
  segments = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 13, 12]))[None].expand(2, -1)
  _compare(2, segments=segments, window=6)


def test_bf16_inputs_come_back_in_bf16():
  index = rb.layout_indices(8, 1)
  q, k, v = (torch.randn(1, 2, 8, 4).bfloat16().requires_grad_() for _ in range(3))
  out = ra.ring_attention(q, k, v, ra.ThreadRing(1).member(0), index)
  out.sum().backward()
  assert out.dtype == q.grad.dtype == k.grad.dtype == torch.bfloat16
  ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
  torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _group_ring_rank(s, window):
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  dist.init_process_group('gloo')
  cp, rank = dist.get_world_size(), dist.get_rank()
  g = torch.Generator().manual_seed(7)
  q, k, v = (torch.randn(1, 2, s, 4, generator=g) for _ in range(3))
  index = rb.layout_indices(s, cp)
  local = [t[:, :, index[rank]].clone().requires_grad_() for t in (q, k, v)]
  out = ra.ring_attention(*local, ra.GroupRing(dist.group.WORLD), index, None, window)
  return out.detach(), torch.autograd.grad(out.sum(), local)


def test_group_ring_over_processes_matches_threads():
  from tests import world  # pylint: disable=import-outside-toplevel
  s, window = 16, 6
  got = world.run(_group_ring_rank, 2, s, window)
  index = rb.layout_indices(s, 2)
  g = torch.Generator().manual_seed(7)
  q, k, v = (torch.randn(1, 2, s, 4, generator=g) for _ in range(3))

  def rank(r, ring):
    local = [t[:, :, index[r]].clone().requires_grad_() for t in (q, k, v)]
    out = ra.ring_attention(*local, ring, index, None, window)
    return out.detach(), torch.autograd.grad(out.sum(), local)

  for (out, grads), (want, want_grads) in zip(got, _on_ring(2, rank)):
    assert torch.equal(out, want)
    for a, b in zip(grads, want_grads):
      assert torch.equal(a, b)


def _stop_rank_1_then_exchange(timeout_s):
  import datetime  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=timeout_s))
  if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # a stopped peer (killed by world.run afterwards)
  ra.GroupRing(dist.group.WORLD).start(torch.ones(4), 7).wait()


def test_a_stopped_rank_fails_the_ring_exchange_naming_rank_and_exchange():
  from tests import world  # pylint: disable=import-outside-toplevel
  with pytest.raises(RuntimeError, match=r'rank 0: ring attention exchange 7 \(from rank 1, to rank 1\) failed'):
    world.run(_stop_rank_1_then_exchange, 2, 3, timeout=90)
