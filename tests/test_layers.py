"""Building blocks against their definitions."""

import torch

from model import layers


def test_rms_norm_definition():
  x, w = torch.randn(2, 3, 8), torch.randn(8)
  expected = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
  torch.testing.assert_close(layers.rms_norm(x, w, 1e-5), expected)


def test_dropout_rate_scale_and_keys():
  x = torch.ones(2, 1000)
  out = layers.dropout(x, 0.25, (0, 'd'), torch.tensor([5, 6]))
  assert set(out.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
  assert abs((out == 0).float().mean().item() - 0.25) < 0.05
  again = layers.dropout(x[:1], 0.25, (0, 'd'), torch.tensor([6]))
  assert torch.equal(out[1:], again)                   # sample 6's mask is its own
  assert torch.equal(layers.dropout(x, 0.25, None, None), x)
