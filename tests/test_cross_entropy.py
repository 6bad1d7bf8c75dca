"""model/cross_entropy.py: F.cross_entropy's loss bit for bit, its gradient to an ulp, in one backward pass."""
import pytest
import torch
import torch.nn.functional as F

from model import cross_entropy


def _case(dtype, padded=0, seed=0):
  g = torch.Generator().manual_seed(seed)
  vocab = 97
  logits = (torch.randn(3, 40, vocab + padded, generator=g) * 4).to(dtype)
  labels = torch.randint(0, vocab, (3, 40), generator=g)
  labels[1, 5:9] = cross_entropy.IGNORE_INDEX
  weight = torch.rand(3, 40, generator=g)
  return logits, labels, weight, vocab


def _loss_and_grad(fn, logits, labels, weight, vocab):
  x = logits.clone().requires_grad_()
  loss = fn(x, labels, vocab)
  (loss * weight).sum().backward()
  return loss, x.grad


def _reference(logits_bsv, labels_bs, vocab_size):
  logits = logits_bsv[..., :vocab_size].float()
  return F.cross_entropy(logits.flatten(0, 1), labels_bs.flatten(), reduction='none').view_as(labels_bs)


@pytest.mark.parametrize('dtype, padded', [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 31)])
def test_per_token_is_f_cross_entropy(dtype, padded):
  case = _case(dtype, padded)
  loss, grad = _loss_and_grad(cross_entropy.per_token, *case)
  want_loss, want_grad = _loss_and_grad(_reference, *case)
  assert loss.dtype == torch.float32 and torch.equal(loss, want_loss)      # the same bits
  assert grad.dtype == dtype and torch.equal(grad[..., case[3]:], torch.zeros_like(grad[..., case[3]:]))
  ulp = torch.finfo(dtype).eps
  torch.testing.assert_close(grad, want_grad, rtol=ulp, atol=1e-7)
  assert torch.equal(loss[1, 5:9], torch.zeros(4)) and torch.equal(grad[1, 5:9], torch.zeros_like(grad[1, 5:9]))


def test_per_token_gradient_is_softmax_minus_onehot_in_float64():
  logits, labels, weight, vocab = _case(torch.float32, seed=3)
  _, grad = _loss_and_grad(cross_entropy.per_token, logits, labels, weight, vocab)
  probs = torch.softmax(logits.double(), -1)
  onehot = F.one_hot(labels.clamp(min=0), vocab).double()
  kept = (labels != cross_entropy.IGNORE_INDEX).double()[..., None]
  torch.testing.assert_close(grad.double(), (probs - onehot) * weight.double()[..., None] * kept, rtol=1e-5, atol=1e-7)


def test_traced_is_the_same_loss():
  logits, labels, _, vocab = _case(torch.bfloat16, padded=3)
  assert torch.equal(cross_entropy.traced(logits, labels, vocab), cross_entropy.per_token(logits, labels, vocab))


def test_a_second_backward_is_refused():
  logits, labels, _, vocab = _case(torch.float32)
  x = logits.clone().requires_grad_()
  loss = cross_entropy.per_token(x, labels, vocab).sum()
  loss.backward(retain_graph=True)
  with pytest.raises(RuntimeError, match='backward ran twice'):
    loss.backward()
