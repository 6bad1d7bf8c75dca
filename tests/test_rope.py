"""RoPE against its definition and transformers' rotate-half."""
import math

import pytest
import torch

from model import rope


def test_rope_scores_depend_only_on_relative_position():
  d = 16
  q, k = torch.randn(d), torch.randn(d)

  def rotated(v, pos):
    cos, sin = rope.rope_cos_sin(torch.tensor([[pos]]), d, 10000.0, torch.float32)
    return rope.apply_rope(v.view(1, 1, 1, d), cos, sin).flatten()

  s1 = rotated(q, 7) @ rotated(k, 3)
  s2 = rotated(q, 104) @ rotated(k, 100)
  torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
  torch.testing.assert_close(rotated(q, 0), q)
  assert math.isclose(rotated(q, 5).norm().item(), q.norm().item(), rel_tol=1e-5)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_rope_is_transformers_rotate_half_bit_for_bit(dtype):
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
  q, k = torch.randn(2, 4, 16, 32).to(dtype), torch.randn(2, 2, 16, 32).to(dtype)
  cos, sin = rope.rope_cos_sin(torch.arange(16)[None].expand(2, -1) * 37, 32, 10000.0, dtype)
  want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
  assert torch.equal(rope.apply_rope(q, cos, sin), want_q)
  assert torch.equal(rope.apply_rope(k, cos, sin), want_k)


def test_partial_rope_passes_the_tail_through():
  x = torch.randn(1, 2, 3, 8)
  cos, sin = rope.rope_cos_sin(torch.arange(3)[None] + 1, 4, 10000.0, torch.float32)
  out = rope.apply_rope(x, cos, sin)
  assert torch.equal(out[..., 4:], x[..., 4:])
  assert not torch.allclose(out[..., :4], x[..., :4])
