"""Which blocks ring attention (parallel/ring_attention.py) computes, and with which mask.

Which query may see which key comes from the tokens' global sequence indices (causality, the
sliding window: HF's i - window < j <= i; Llama 4's chunked attention: i and j in the same
`chunk` of positions) and, for packed rows, their document ids. Each rank's slice is cut into
`chunks` pieces (the load-balanced layout gives a rank two chunks of the sequence,
`layout_indices`); a (query piece, key piece) pair that the mask excludes entirely is skipped,
so a window skips the ring steps it excludes, and causal attention skips the future chunks.
Which pairs run, and which need no mask, is decided on the host from the layout's positions.
"""
import typing

import torch

import host_values


class Reach(typing.NamedTuple):
  """Which earlier keys a query sees besides causality: the last `window` positions (HF's sliding
  window, 0: all) and those of its own `chunk` of positions (Llama 4's chunked attention, 0: all)."""
  window: int = 0
  chunk: int = 0


def layout_indices(seq_length, cp):
  """[cp, seq_length / cp]: the global sequence indices of each rank's tokens. The sequence
  is cut in 2 cp chunks and rank i holds chunks i and 2cp-1-i (Megatron's and torchtitan's
  load balance: every rank gets an early and a late chunk, so equal causal work)."""
  chunks = torch.arange(seq_length).view(2 * cp, -1)
  return torch.stack([torch.cat([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def _span(piece):
  """(first, last) of a piece of positions that is one run of consecutive ones, else None."""
  first, last = int(piece[0]), int(piece[-1])
  return (first, last) if last - first + 1 == len(piece) and bool((piece.diff() == 1).all()) else None


def _visible(q_span, k_span, reach):
  """(some, every): whether some or every query of a run of positions attends some or every key
  of another run (causal, and within the window when one is set); None for pieces not runs, and
  with chunks (their whole mask decides)."""
  if q_span is None or k_span is None or reach.chunk:
    return None
  (q0, q1), (k0, k1), window = q_span, k_span, reach.window
  some = k0 <= q1 and (not window or k1 > q0 - window)
  every = k1 <= q0 and (not window or k0 > q1 - window)
  return some, every


def _allowed(q_index, k_index, reach):
  """[sq, sk] on the host: which query position attends which key position."""
  with host_values.host():
    allowed = k_index[None, :] <= q_index[:, None]
    if reach.window:
      allowed = allowed & (k_index[None, :] > q_index[:, None] - reach.window)
    if reach.chunk:
      allowed = allowed & (k_index[None, :] // reach.chunk == q_index[:, None] // reach.chunk)
    return allowed


def _mask(q_index, k_index, q_seg, k_seg, reach, like, visible=None):
  """[b or 1, 1, 1, sq, sk] (True = attend) on `like`'s device, None when every pair attends,
  False when none does. The positions are the layout's, on the host: which blocks are skipped
  or unmasked is decided there (from their runs, `visible`, where known) without a device sync
  and exactly in a trace; only the document ids of packed rows are read off the device."""
  allowed = None
  if visible is None:                  # pieces that are not runs: their whole mask decides
    allowed = _allowed(q_index, k_index, reach)
    with host_values.host():
      visible = bool(allowed.any()), bool(allowed.all())
  some, every = visible
  if not some:
    return False
  if every and q_seg is None:
    return None
  allowed = host_values.on_device(allowed if allowed is not None else _allowed(q_index, k_index, reach), like)
  if q_seg is None:
    return allowed[None, None, None]
  mask = allowed[None, None, None] & (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
  partly = 'ring attention: the blocks of packed rows that positions allow are partly masked (their mask kept)'
  if not host_values.read(mask, lambda m: bool(m.any()), partly, True):
    return False
  return None if host_values.read(mask, lambda m: bool(m.all()), partly, False) else mask


def pairs(ring, src, index_by_rank, seg_by_rank, reach, chunks, like):
  """(query piece, key piece, mask) for the block of rank `src`, without the excluded pairs."""
  with host_values.host():
    qi, ki = index_by_rank[ring.rank].chunk(chunks), index_by_rank[src].chunk(chunks)
    q_spans, k_spans = [_span(p) for p in qi], [_span(p) for p in ki]
  qs = seg_by_rank[ring.rank].chunk(chunks, 1) if seg_by_rank is not None else [None] * chunks
  ks = seg_by_rank[src].chunk(chunks, 1) if seg_by_rank is not None else [None] * chunks
  for a in range(chunks):
    for c in range(chunks):
      mask = _mask(qi[a], ki[c], qs[a], ks[c], reach, like, _visible(q_spans[a], k_spans[c], reach))
      if mask is not False:
        yield a, c, mask
