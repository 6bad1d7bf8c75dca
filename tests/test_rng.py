"""Keyed randomness."""
import torch

import rng


def test_same_key_same_numbers_and_different_keys_differ():
  assert rng.key_to_seed(1, 'init', 'w') == rng.key_to_seed(1, 'init', 'w')
  assert torch.equal(rng.normal((4, 4), 1.0, 1, 'a'), rng.normal((4, 4), 1.0, 1, 'a'))
  assert not torch.equal(rng.uniform((8,), 1, 'a', 0), rng.uniform((8,), 1, 'a', 1))
  assert rng.key_to_seed(1, 'a', 2) != rng.key_to_seed(1, 'a', '2')
  assert 0 <= rng.key_to_seed('x') < 2**63


def test_draws_ignore_the_global_generator():
  torch.manual_seed(0)
  a = rng.normal((3,), 1.0, 'k')
  torch.manual_seed(99)
  torch.randn(10)
  assert torch.equal(a, rng.normal((3,), 1.0, 'k'))
