"""Building blocks against their definitions."""
import math

import pytest
import torch

from model import layers


def test_rms_norm_definition():
  x, w = torch.randn(2, 3, 8), torch.randn(8)
  expected = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
  torch.testing.assert_close(layers.rms_norm(x, w, 1e-5), expected)


def test_rope_scores_depend_only_on_relative_position():
  d = 16
  q, k = torch.randn(d), torch.randn(d)

  def rotated(v, pos):
    cos, sin = layers.rope_cos_sin(torch.tensor([[pos]]), d, 10000.0, torch.float32)
    return layers.apply_rope(v.view(1, 1, 1, d), cos, sin).flatten()

  s1 = rotated(q, 7) @ rotated(k, 3)
  s2 = rotated(q, 104) @ rotated(k, 100)
  torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
  torch.testing.assert_close(rotated(q, 0), q)
  assert math.isclose(rotated(q, 5).norm().item(), q.norm().item(), rel_tol=1e-5)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_rope_is_transformers_rotate_half_bit_for_bit(dtype):
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
  q, k = torch.randn(2, 4, 16, 32).to(dtype), torch.randn(2, 2, 16, 32).to(dtype)
  cos, sin = layers.rope_cos_sin(torch.arange(16)[None].expand(2, -1) * 37, 32, 10000.0, dtype)
  want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
  assert torch.equal(layers.apply_rope(q, cos, sin), want_q)
  assert torch.equal(layers.apply_rope(k, cos, sin), want_k)


def test_partial_rope_passes_the_tail_through():
  x = torch.randn(1, 2, 3, 8)
  cos, sin = layers.rope_cos_sin(torch.arange(3)[None] + 1, 4, 10000.0, torch.float32)
  out = layers.apply_rope(x, cos, sin)
  assert torch.equal(out[..., 4:], x[..., 4:])
  assert not torch.allclose(out[..., :4], x[..., :4])


def test_dropout_rate_scale_and_keys():
  x = torch.ones(2, 1000)
  out = layers.dropout(x, 0.25, (0, 'd'), torch.tensor([5, 6]))
  assert set(out.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
  assert abs((out == 0).float().mean().item() - 0.25) < 0.05
  again = layers.dropout(x[:1], 0.25, (0, 'd'), torch.tensor([6]))
  assert torch.equal(out[1:], again)                   # sample 6's mask is its own
  assert torch.equal(layers.dropout(x, 0.25, None, None), x)


def test_attention_mask_is_causal_within_documents():
  mask = layers.attention_mask(torch.tensor([[0, 0, 1, 1]]), 4)[0, 0]
  expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
  assert torch.equal(mask, expected)
  assert layers.attention_mask(None, 4) is None
