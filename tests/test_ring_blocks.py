"""parallel/ring_blocks.py: the load-balanced layout, and which blocks the ring computes with
which mask, decided on the host (a traced step skips exactly what a real one does)."""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import host_values
from parallel import ring_attention as ra, ring_blocks as rb


def test_layout_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i():
  assert rb.layout_indices(8, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
  assert sorted(rb.layout_indices(24, 3).flatten().tolist()) == list(range(24))


@pytest.mark.parametrize('fake', [False, True])
def test_window_skips_the_blocks_it_excludes_in_a_trace_too(fake):
  """The positions decide on the host which blocks run and which need a mask: a traced step
  (fake q) skips exactly the real step's blocks and assumes nothing for them."""
  index = rb.layout_indices(32, 4)   # chunks of 4 tokens
  ring = ra.ThreadRing(4).member(3)  # chunks 3 and 4
  with contextlib.ExitStack() as stack:
    if fake:
      stack.enter_context(FakeTensorMode())
    assumed = stack.enter_context(host_values.recording())
    q = torch.zeros(1, 2, 8, 4)
    blocks = lambda w: [(src, a, c, mask is None) for src in range(4)
                        for a, c, mask in rb.pairs(ring, src, index, None, rb.Reach(w), 2, q)]
    causal, window = blocks(0), blocks(3)
  assert host_values.is_fake(q) == fake and assumed == {}
  assert len(causal) == 3 + 2 + 2 + 2   # causal: 3 of the own 4 pairs, the earlier chunk of each other block
  assert [b[:3] for b in causal if not b[3]] == [(3, 0, 0), (3, 1, 1)]     # the diagonals: the others unmasked
  assert sorted(b[:3] for b in window) == [(2, 0, 0), (3, 0, 0), (3, 1, 0), (3, 1, 1)]   # only neighbouring chunks
