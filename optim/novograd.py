"""NeMo's Novograd, registered as model.optim.name=novograd (optim/optimizers.py)."""
import torch


class Novograd(torch.optim.Optimizer):
  """NeMo's Novograd (Ginsburg et al. 2019, arXiv:1905.11286), without its amsgrad/luc options.

  Per parameter tensor (the "layer" of layer-wise moments), with gradient g:
    v = ||g||^2 while v is 0 (first step), else beta2 v + (1 - beta2) ||g||^2   (one scalar)
    m = beta1 m + g / (sqrt(v) + eps) + weight_decay p
    p = p - lr m
  As in NeMo, m sums whole normalized gradients (no 1 - beta1 factor: NeMo's grad_averaging=False).
  Unlike NeMo, p.grad is left as it was rather than overwritten with the normalized gradient.
  """

  def __init__(self, params, lr=1e-3, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.0):
    if lr < 0 or eps < 0 or not all(0.0 <= b < 1.0 for b in betas):
      raise ValueError(f'Novograd: invalid lr={lr}, eps={eps} or betas={betas}')
    super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

  @torch.no_grad()
  def step(self, closure=None):
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    for group in self.param_groups:
      beta1, beta2 = group['betas']
      for p in group['params']:
        if p.grad is None:
          continue
        state = self.state[p]
        if not state:
          state['step'] = 0
          state['exp_avg'] = torch.zeros_like(p, memory_format=torch.preserve_format)
          state['exp_avg_sq'] = torch.zeros((), dtype=torch.float32, device=p.device)
        state['step'] += 1
        grad_sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
        exp_avg_sq = state['exp_avg_sq']
        # NeMo starts the average at the first nonzero norm; torch.where keeps that without a
        # host sync on the comparison.
        exp_avg_sq.copy_(torch.where(exp_avg_sq == 0, grad_sq, exp_avg_sq * beta2 + grad_sq * (1 - beta2)))
        update = p.grad / (exp_avg_sq.sqrt() + group['eps'])
        if group['weight_decay'] != 0:
          update = update + p * group['weight_decay']
        state['exp_avg'].mul_(beta1).add_(update)
        p.add_(state['exp_avg'], alpha=-group['lr'])
    return loss
