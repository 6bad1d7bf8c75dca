"""Optimizers under NxD Training's names, over a flat dict of named parameters.

Weight decay skips norm weights and all biases unless do_layer_norm_weight_decay.
Embeddings and the LM head are decayed, as in Megatron. Each parameter group carries its
parameters' names (torch's `param_names`), so optimizer state dicts say which tensor is which.
"""
import inspect

import torch

from model import param_table
from optim import muon

OPTIMIZERS = ('adamw', 'adamw_fp32OptState', 'adam', 'sgd', 'adadelta', 'adamax', 'adagrad', 'rmsprop',
              'rprop', 'adafactor', 'novograd', 'muon', 'lion')


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


_ADAM_KEYS = ('lr', 'betas', 'eps', 'weight_decay')

# Constructor and the config keys it takes, per name. Adafactor gets no eps: torch's is a pair
# (eps1, eps2) with its own defaults, not an Adam epsilon. Rprop has no weight decay at all.
_BUILDERS = {
    'adamw': (torch.optim.AdamW, _ADAM_KEYS),
    # fp32 moments under bf16 params come with the precision work; until then this is AdamW.
    'adamw_fp32OptState': (torch.optim.AdamW, _ADAM_KEYS),
    'adam': (torch.optim.Adam, _ADAM_KEYS),
    'sgd': (torch.optim.SGD, ('lr', 'momentum', 'weight_decay')),
    'adadelta': (torch.optim.Adadelta, ('lr', 'eps', 'weight_decay')),
    'adamax': (torch.optim.Adamax, _ADAM_KEYS),
    'adagrad': (torch.optim.Adagrad, ('lr', 'eps', 'weight_decay')),
    'rmsprop': (torch.optim.RMSprop, ('lr', 'eps', 'momentum', 'weight_decay')),
    'rprop': (torch.optim.Rprop, ('lr',)),
    'adafactor': (torch.optim.Adafactor, ('lr', 'weight_decay')),
    'novograd': (Novograd, _ADAM_KEYS),
}


def decays_weight(name: str) -> bool:
  """Whether weight decay applies to parameter `name` by default: not to norms or biases."""
  return not (name.endswith('.bias') or 'layernorm' in name or 'norm.' in name)


def param_groups(params: dict, optim_cfg, with_weight_decay: bool = True) -> list[dict]:
  """[decayed, not decayed] groups of (name, tensor) pairs in dict order; empty groups dropped.

  Weight decay skips norm weights and all biases unless do_layer_norm_weight_decay.
  """
  decay_all = bool(optim_cfg.do_layer_norm_weight_decay)
  unique = {}
  for name, tensor in params.items():  # a tied tensor listed twice is optimized once
    unique.setdefault(id(tensor), (name, tensor))
  decayed = [(n, p) for n, p in unique.values() if decay_all or decays_weight(n)]
  exempt = [(n, p) for n, p in unique.values() if not (decay_all or decays_weight(n))]
  groups = [{'params': decayed, 'weight_decay': float(optim_cfg.weight_decay)},
            {'params': exempt, 'weight_decay': 0.0}]
  if not with_weight_decay:
    groups = [{'params': g['params']} for g in groups]
  return [g for g in groups if g['params']]


CHUNK_BYTES = 32 * 2**20   # the default of `bucket_size_collectives` (MiB)


def chunks(sizes: list, chunk_bytes=CHUNK_BYTES) -> list:
  """[[index, ...], ...]: consecutive runs of the tensors of `sizes` (elements each) of at
  most `chunk_bytes` in fp32 (a tensor larger than that alone), one parameter group each. A
  foreach step (torch's default on CUDA for the optimizers not fused here) allocates its
  temporaries for a whole group at once (AdamW: sqrt(v) and the quotient), so they stay within
  one run instead of the model. On CPU and XLA torch steps one tensor at a time anyway (2x the
  largest tensor, measured). Every element's arithmetic is the same: bitwise equal."""
  out, size = [], 0
  for i, n in enumerate(sizes):
    if out and size + 4 * n <= chunk_bytes:
      out[-1].append(i)
      size += 4 * n
    else:
      out.append([i])
      size = 4 * n
  return out


def _chunked(groups, chunk_bytes):
  """`groups` with each split into groups of runs of at most `chunk_bytes` (see `chunks`)."""
  out = []
  for g in groups:
    pairs = g['params']
    for run in chunks([p.numel() for _, p in pairs], chunk_bytes):
      out.append({**g, 'params': [pairs[i] for i in run]})
  return out


def make_optimizer(params: dict, optim_cfg, chunk_bytes=CHUNK_BYTES, matrices=None) -> torch.optim.Optimizer:
  """The optimizer `optim_cfg.name` over `params` (name -> leaf tensor), grouped for weight decay,
  each group split into runs of at most `chunk_bytes` of fp32 (see `chunks`). `matrices`: what
  Muon assembles its whole matrices with (optim/matrices.py; None: `params` are whole)."""
  if optim_cfg.name in ('muon', 'lion'):
    return _matrix_or_sign(params, optim_cfg, matrices)
  if optim_cfg.name not in _BUILDERS:
    raise ValueError(_unknown_name(optim_cfg.name))
  cls, keys = _BUILDERS[optim_cfg.name]
  kwargs = {k: tuple(optim_cfg[k]) if k == 'betas' else float(optim_cfg[k]) for k in keys}
  kwargs.pop('weight_decay', None)  # set per group
  device_types = {p.device.type for p in params.values()}
  accepts = inspect.signature(cls.__init__).parameters
  if 'xla' in device_types and 'capturable' in accepts:
    kwargs['capturable'] = True     # the step count on the device: no host value inside the graph
  elif device_types == {'cuda'} and 'fused' in accepts:
    # One kernel per tensor list. On CPU fused AdamW was 4x faster (32M params: 146 -> 35 ms) but
    # moved a TP-sharded bias past the 1e-5 layout-parity bound: on CPU torch steps one tensor at
    # a time, and Adam(W)'s large fp32 rows take optim/sr_update.py's one pass (Updater.fused).
    kwargs['fused'] = True
  return cls(_chunked(param_groups(params, optim_cfg, 'weight_decay' in keys), chunk_bytes), **kwargs)


class _Whole:
  """Matrices of a single device: every parameter is its whole self."""

  def __init__(self, params):
    self.params = params

  def whole(self, name, t):  # pylint: disable=unused-argument
    return t

  def part(self, name, t):  # pylint: disable=unused-argument
    return t

  def matrix_shape(self, name):
    return tuple(self.params[name].shape[-2:])


def _matrix_or_sign(params, optim_cfg, matrices):
  """Muon (hidden matrices; AdamW for the rest) or Lion, grouped by decay (and by rule)."""
  betas = tuple(optim_cfg.betas)
  if optim_cfg.name == 'lion':
    return muon.Lion(param_groups(params, optim_cfg), float(optim_cfg.lr), betas)
  groups = []
  for g in param_groups(params, optim_cfg):
    for rule in (True, False):
      pairs = [(n, p) for n, p in g['params'] if param_table.is_hidden_matrix(n, p.dim()) == rule]
      if pairs:
        groups.append({**g, 'params': pairs, 'muon': rule})
  m = optim_cfg.muon
  return muon.Muon(groups, matrices or _Whole(params), float(optim_cfg.lr), betas, float(optim_cfg.eps),
                   float(m.momentum), bool(m.nesterov), int(m.ns_steps), m.ns_dtype, m.adjust_lr)


def _unknown_name(name):
  return f"model.optim.name={name!r} is unknown; valid: {', '.join(OPTIMIZERS)}"


def check(optim_cfg) -> list[str]:
  """Problems with `model.optim` (not its `sched`), each naming the key and what would be valid."""
  p = 'model.optim.'
  problems = []
  if optim_cfg.name not in OPTIMIZERS:
    problems.append(_unknown_name(optim_cfg.name))
  if not optim_cfg.lr > 0:
    problems.append(f'{p}lr={optim_cfg.lr!r} must be > 0')
  betas = tuple(optim_cfg.betas)
  if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
    problems.append(f'{p}betas={betas!r} must be two values, each in [0, 1)')
  if not optim_cfg.eps > 0:
    problems.append(f'{p}eps={optim_cfg.eps!r} must be > 0')
  if not optim_cfg.weight_decay >= 0:
    problems.append(f'{p}weight_decay={optim_cfg.weight_decay!r} must be >= 0')
  if not optim_cfg.momentum >= 0:
    problems.append(f'{p}momentum={optim_cfg.momentum!r} must be >= 0')
  if optim_cfg.name == 'muon':
    m = optim_cfg.muon
    if not 0.0 <= m.momentum < 1.0:
      problems.append(f'{p}muon.momentum={m.momentum!r} must be in [0, 1)')
    if m.ns_steps < 1:
      problems.append(f'{p}muon.ns_steps={m.ns_steps!r} must be >= 1')
    if m.ns_dtype not in muon.NS_DTYPES:
      problems.append(f'{p}muon.ns_dtype={m.ns_dtype!r}; valid: {", ".join(muon.NS_DTYPES)}')
    if m.adjust_lr not in muon.ADJUST_LR:
      problems.append(f'{p}muon.adjust_lr={m.adjust_lr!r}; valid: {", ".join(muon.ADJUST_LR)}')
  if optim_cfg.name == 'rprop' and optim_cfg.weight_decay > 0:
    problems.append(f'{p}weight_decay={optim_cfg.weight_decay!r} would be ignored: rprop has no weight '
                    f'decay; set it to 0')
  return problems
