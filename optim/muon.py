"""Muon and Lion (model.optim.name=muon | lion), over the rows a rank owns under any layout.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025): the hidden matrices (every 2-D weight of
the layers, each expert's matrix, LoRA factors) step by the orthogonalized momentum,

    B <- mu B + (1 - mu) G;  U = (1 - mu) G + mu B (Nesterov) or B
    O = NewtonSchulz5(U)                      (the quintic iteration, on the whole matrix)
    W <- W (1 - lr wd) - lr s O,  s = 0.2 sqrt(max(A, B)) (match_rms_adamw) or sqrt(max(1, A/B))

torch.optim.Muon's arithmetic, in `muon.ns_dtype` (bf16 as torch's, or fp32 where layouts must
agree to fp32's round-off). Everything else (embeddings, the head, norms, biases, sinks) steps
by AdamW with the same lr, betas, eps and weight decay, as the Muon papers train. The momentum is
elementwise, so it is kept (and checkpointed) on the owned rows like Adam's moments; only U is
assembled whole for the iteration (optim/matrices.py) and cut back to the rows.

Lion (Chen et al. 2023): c = b1 m + (1 - b1) g; W <- W (1 - lr wd) - lr sign(c);
m <- b2 m + (1 - b2) g. Elementwise: every layout's rows step alike.
"""
import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)    # torch.optim.Muon's (Keller Jordan's)
NS_DTYPES = {'bfloat16': torch.bfloat16, 'float32': torch.float32}
ADJUST_LR = ('match_rms_adamw', 'original')


def newton_schulz(g, steps, dtype, eps=1e-7):
  """The orthogonalized g (a 2-D matrix, or a stack of them): the quintic Newton-Schulz
  iteration of torch.optim.Muon, on each matrix, in `dtype`."""
  a, b, c = NS_COEFFICIENTS
  x = g.to(dtype)
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = x.transpose(-2, -1)
  x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
  mm = torch.addmm if x.dim() == 2 else torch.baddbmm       # torch's own ops, rounded as it rounds them
  for _ in range(steps):
    gram = x @ x.transpose(-2, -1)
    x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
  return x.transpose(-2, -1) if tall else x


def check(optim_cfg) -> list:
  """Problems with model.optim.muon (name=muon)."""
  p, m, problems = 'model.optim.muon.', optim_cfg.muon, []
  if not 0.0 <= m.momentum < 1.0:
    problems.append(f'{p}momentum={m.momentum!r} must be in [0, 1)')
  if m.ns_steps < 1:
    problems.append(f'{p}ns_steps={m.ns_steps!r} must be >= 1')
  if m.ns_dtype not in NS_DTYPES:
    problems.append(f'{p}ns_dtype={m.ns_dtype!r}; valid: {", ".join(NS_DTYPES)}')
  if m.adjust_lr not in ADJUST_LR:
    problems.append(f'{p}adjust_lr={m.adjust_lr!r}; valid: {", ".join(ADJUST_LR)}')
  return problems


def adjusted_lr(lr, rule, shape):
  rows, cols = shape
  return lr * (0.2 * math.sqrt(max(rows, cols)) if rule == 'match_rms_adamw' else math.sqrt(max(1.0, rows / cols)))


class Muon(torch.optim.Optimizer):
  """Muon over the hidden matrices, AdamW over the rest; `matrices`: optim/matrices.Matrices
  (whole / part / matrix_shape by parameter name). Groups carry `param_names` and `muon`."""

  def __init__(self, groups, matrices, lr, betas, eps, momentum, nesterov, ns_steps, ns_dtype, adjust_lr):
    super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
                                  ns_steps=ns_steps, ns_dtype=ns_dtype, adjust_lr=adjust_lr))
    self.matrices = matrices

  @torch.no_grad()
  def step(self, closure=None):  # pylint: disable=unused-argument
    for group in self.param_groups:
      for name, p in zip(group['param_names'], group['params']):
        if p.grad is None:
          continue
        state = self.state[p]
        state['step'] = _count(state) + 1
        g = p.grad.to(p.dtype)             # 16-bit gradients (bf16SR) against widened fp32 rows
        if group['muon']:
          self._muon(group, name, p, g, state)
        else:
          _adamw(group, p, g, state)
    return None

  def _muon(self, group, name, p, g, state):
    mu = group['momentum']
    buf = state.setdefault('momentum_buffer', torch.zeros_like(p))
    buf.lerp_(g, 1 - mu)
    u = g.lerp(buf, mu) if group['nesterov'] else buf
    whole = self.matrices.whole(name, u)
    o = self.matrices.part(name, newton_schulz(whole, group['ns_steps'], NS_DTYPES[group['ns_dtype']]))
    p.mul_(1 - group['lr'] * group['weight_decay'])
    p.add_(o.to(p.dtype), alpha=-adjusted_lr(group['lr'], group['adjust_lr'], self.matrices.matrix_shape(name)))


def _count(state) -> int:
  """The steps taken, a Python int (a checkpoint loads it as a tensor: the bias corrections would
  then round in fp32, not as an uninterrupted run's)."""
  step = state.get('step', 0)
  return int(step.item()) if torch.is_tensor(step) else step


def _adamw(group, p, g, state):
  """torch's AdamW, one tensor."""
  (b1, b2), t = group['betas'], state['step']
  m = state.setdefault('exp_avg', torch.zeros_like(p))
  v = state.setdefault('exp_avg_sq', torch.zeros_like(p))
  m.lerp_(g, 1 - b1)
  v.mul_(b2).addcmul_(g, g, value=1 - b2)
  p.mul_(1 - group['lr'] * group['weight_decay'])
  denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(group['eps'])
  p.addcdiv_(m, denom, value=-group['lr'] / (1 - b1 ** t))


class Lion(torch.optim.Optimizer):
  """Lion (sign of the interpolated momentum, decoupled weight decay)."""

  def __init__(self, groups, lr, betas):
    super().__init__(groups, dict(lr=lr, betas=betas))

  @torch.no_grad()
  def step(self, closure=None):  # pylint: disable=unused-argument
    for group in self.param_groups:
      b1, b2 = group['betas']
      for p in group['params']:
        if p.grad is None:
          continue
        state = self.state[p]
        state['step'] = _count(state) + 1
        m, g = state.setdefault('exp_avg', torch.zeros_like(p)), p.grad.to(p.dtype)
        p.mul_(1 - group['lr'] * group['weight_decay'])
        p.add_(torch.sign(m.lerp(g, 1 - b1)), alpha=-group['lr'])
        m.lerp_(g, 1 - b2)
    return None
