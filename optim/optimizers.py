"""Optimizers by name (`model.optim.name`), over a flat dict of named parameters.

Each name is one `Entry` in `ENTRIES`: how to build it, how many state tensors shaped like a
parameter it keeps (the memory estimate), which of them each parameter holds (the checkpoint's
layout, the same on every rank), and what of its own config it checks. `register` adds one; a
fork's optimizer is a class in its own file and one `register` line below (docs/extending.md).

`build(params, optim_cfg, matrices, chunk_bytes)` gets this rank's trained rows (name -> fp32 leaf
tensor: under ZeRO-1 the rows it owns, under TP its box), the `model.optim` section, what
assembles whole matrices from those rows across the layout (optim/matrices.py: `whole`, `part`,
`matrix_shape` by name; for an update that is not elementwise, like Muon's), and the fp32 bytes
of a foreach run (`chunks`).

Weight decay skips norm weights and all biases unless do_layer_norm_weight_decay.
Embeddings and the LM head are decayed, as in Megatron. Each parameter group carries its
parameters' names (torch's `param_names`), so optimizer state dicts say which tensor is which.
"""
import dataclasses
import inspect
from typing import Callable, Optional, Union

import torch

from model import param_table
from optim import muon, novograd


@dataclasses.dataclass(frozen=True)
class Entry:
  build: Callable                      # (params, optim_cfg, matrices, chunk_bytes) -> torch.optim.Optimizer
  states: Union[float, Callable] = 2   # state tensors shaped like a parameter: a number, or (name, ndim) -> number
  holds: Optional[Callable] = None     # (key, name, ndim) -> bool: which state keys parameter `name` keeps; None: all
  check: Optional[Callable] = None     # (optim_cfg) -> [problem, ...] with its own keys


ENTRIES = {}


def register(name: str, entry: Entry):
  """Make `name` a valid model.optim.name. A name taken is refused (a fork's optimizer never
  silently replaces another)."""
  if name in ENTRIES:
    raise ValueError(f'optimizer {name!r} is registered already; choose another name')
  ENTRIES[name] = entry


def entry(name: str) -> Entry:
  if name not in ENTRIES:
    raise ValueError(_unknown_name(name))
  return ENTRIES[name]


def state_count(optim_name, name, ndim) -> float:
  """State tensors shaped like parameter `name` (of global rank `ndim`) the optimizer keeps."""
  states = entry(optim_name).states
  return states(name, ndim) if callable(states) else states


def holds_state(optim_name, key, name, ndim) -> bool:
  """Whether optimizer `optim_name` keeps state tensor `key` for parameter `name` (of global rank
  `ndim`): what a checkpoint's layout declares, the same on every rank."""
  holds = entry(optim_name).holds
  return holds is None or holds(key, name, ndim)


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
  """The optimizer `optim_cfg.name` over `params` (name -> leaf tensor). `matrices`: what
  assembles whole matrices from this rank's rows (optim/matrices.py; None: `params` are whole)."""
  return entry(optim_cfg.name).build(params, optim_cfg, matrices or _Whole(params), chunk_bytes)


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


def torch_optimizer(cls, keys) -> Callable:
  """A `build` for optimizer class `cls` (torch's signature: parameter groups, then keyword
  arguments) taking config keys `keys` of model.optim, grouped for weight decay, each group split
  into runs of at most `chunk_bytes` of fp32 (see `chunks`)."""

  def build(params, optim_cfg, matrices, chunk_bytes):  # pylint: disable=unused-argument
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

  return build


def _muon(params, optim_cfg, matrices, chunk_bytes):  # pylint: disable=unused-argument
  """Muon over the hidden matrices and AdamW over the rest, grouped by decay and by rule."""
  groups = []
  for g in param_groups(params, optim_cfg):
    for rule in (True, False):
      pairs = [(n, p) for n, p in g['params'] if param_table.is_hidden_matrix(n, p.dim()) == rule]
      if pairs:
        groups.append({**g, 'params': pairs, 'muon': rule})
  m = optim_cfg.muon
  return muon.Muon(groups, matrices, float(optim_cfg.lr), tuple(optim_cfg.betas), float(optim_cfg.eps),
                   float(m.momentum), bool(m.nesterov), int(m.ns_steps), m.ns_dtype, m.adjust_lr)


def _lion(params, optim_cfg, matrices, chunk_bytes):  # pylint: disable=unused-argument
  return muon.Lion(param_groups(params, optim_cfg), float(optim_cfg.lr), tuple(optim_cfg.betas))


def _muon_states(name, ndim):
  """Muon's momentum on the layers' matrices; AdamW's two moments elsewhere."""
  return 1 if param_table.is_hidden_matrix(name, ndim) else 2


def _muon_holds(key, name, ndim):
  return (key == 'momentum_buffer') == param_table.is_hidden_matrix(name, ndim)


def _rprop_check(optim_cfg):
  if optim_cfg.weight_decay > 0:
    return [f'model.optim.weight_decay={optim_cfg.weight_decay!r} would be ignored: rprop has no weight '
            f'decay; set it to 0']
  return []


_ADAM_KEYS = ('lr', 'betas', 'eps', 'weight_decay')
# The config keys each constructor takes. Adafactor gets no eps: torch's is a pair (eps1, eps2) with
# its own defaults, not an Adam epsilon. Rprop has no weight decay at all.
register('adamw', Entry(torch_optimizer(torch.optim.AdamW, _ADAM_KEYS)))
# fp32 moments under bf16 params come with the precision work; until then this is AdamW.
register('adamw_fp32OptState', Entry(torch_optimizer(torch.optim.AdamW, _ADAM_KEYS)))
register('adam', Entry(torch_optimizer(torch.optim.Adam, _ADAM_KEYS)))
register('sgd', Entry(torch_optimizer(torch.optim.SGD, ('lr', 'momentum', 'weight_decay')), states=0))
register('adadelta', Entry(torch_optimizer(torch.optim.Adadelta, ('lr', 'eps', 'weight_decay'))))
register('adamax', Entry(torch_optimizer(torch.optim.Adamax, _ADAM_KEYS)))
register('adagrad', Entry(torch_optimizer(torch.optim.Adagrad, ('lr', 'eps', 'weight_decay')), states=1))
register('rmsprop', Entry(torch_optimizer(torch.optim.RMSprop, ('lr', 'eps', 'momentum', 'weight_decay')), states=1))
register('rprop', Entry(torch_optimizer(torch.optim.Rprop, ('lr',)), check=_rprop_check))
register('adafactor', Entry(torch_optimizer(torch.optim.Adafactor, ('lr', 'weight_decay')), states=1))
register('novograd', Entry(torch_optimizer(novograd.Novograd, _ADAM_KEYS), states=1))
register('muon', Entry(_muon, states=_muon_states, holds=_muon_holds, check=muon.check))
register('lion', Entry(_lion, states=1))
OPTIMIZERS = tuple(ENTRIES)     # the built-in names


def _unknown_name(name):
  return f"model.optim.name={name!r} is unknown; valid: {', '.join(ENTRIES)}"


def check(optim_cfg) -> list[str]:
  """Problems with `model.optim` (not its `sched`), each naming the key and what would be valid."""
  p = 'model.optim.'
  problems = []
  if optim_cfg.name not in ENTRIES:
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
  own = ENTRIES[optim_cfg.name].check if optim_cfg.name in ENTRIES else None
  return problems + (own(optim_cfg) if own else [])
