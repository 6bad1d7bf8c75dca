"""model/attention.py: the masks against their definitions (attention against SDPA and
transformers: tests/test_transformer.py, tests/test_ring_attention.py)."""
import torch

from model import attention


def test_attention_mask_is_causal_within_documents():
  mask = attention.attention_mask(torch.tensor([[0, 0, 1, 1]]), 4)[0, 0]
  expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
  assert torch.equal(mask, expected)
  assert attention.attention_mask(None, 4) is None
