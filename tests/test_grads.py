"""parallel/grads.py: the per-tensor sums of squares behind the global norm."""
import pytest
import torch

from parallel import grads
from tests import parity


def _tensors():
  g = torch.Generator().manual_seed(0)
  return [torch.randn(300, 7, generator=g).to(torch.bfloat16), torch.randn(50, generator=g),
          torch.randn(2, 3, 4, generator=g).to(torch.bfloat16), torch.zeros(5), torch.randn(1, generator=g) * 1e3]


def test_multi_tensor_square_sums_are_each_tensors_sum_of_squares_in_order():
  tensors = _tensors()
  got = grads.square_sums(tensors, multi_tensor=True)      # CUDA's path, mixed dtypes in one list
  want = grads.square_sums(tensors, multi_tensor=False)
  assert [s.dtype for s in got] == [torch.float32] * len(tensors)
  exact = [t.double().square().sum().float() for t in tensors]
  for t, a, b, c in zip(tensors, got, want, exact):   # fp32 sums of numel squares, in other orders
    rtol = parity.roundoff(t.numel(), slack=1)        # (each square rounds once at most)
    torch.testing.assert_close(a, b, rtol=rtol, atol=0)
    torch.testing.assert_close(b, c, rtol=rtol, atol=0)


def test_square_sums_on_the_cpu_use_squares_of_each_tensor():
  seen = []
  out = grads.square_sums(_tensors(), squares_of=lambda t: seen.append(t.shape) or t.float().square().sum())
  assert seen == [t.shape for t in _tensors()] and len(out) == 5
  assert grads.square_sums([]) == []


@pytest.mark.parametrize('multi_tensor', [False, True])
def test_square_sums_of_gradients_that_require_grad_are_detached(multi_tensor):
  t = torch.randn(10, requires_grad=True)
  (s,) = grads.square_sums([t], multi_tensor=multi_tensor)
  assert not s.requires_grad
  torch.testing.assert_close(s, t.detach().square().sum())
