"""Live tensor bytes of a traced step, by category, and their peak.

A dispatch mode that sees every tensor an operation creates (real or fake: under
FakeTensorMode a traced step's tensors have sizes but no storage behind them), counts its
storage's bytes from creation until Python drops the last reference (a weak reference's
callback), and keeps the peak of the sum with what each category held then. Tensors made
before the mode (parameters, optimizer state) are added with `hold`, by category.

What the step makes is counted by when it was made: 'forward' (autograd recording: the
activations and logits the backward keeps, and the forward's temporaries), 'backward' (inside
autograd's backward: the gradients in flight) and 'update' (outside both: the gradient
reduction, the clip and the optimizer's temporaries).
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

HELD = ('params', 'master', 'optimizer', 'grads', 'other')     # made before the step
MADE = ('forward', 'backward', 'update')                       # made by the step


def storage_bytes(t) -> int:
  return t.untyped_storage().nbytes()


def in_backward() -> bool:
  return torch._C._current_graph_task_id() != -1  # pylint: disable=protected-access


class LiveBytes(TorchDispatchMode):
  """with LiveBytes() as live: ...; live.peak, live.at_peak ({category: bytes}), live.now."""

  def __init__(self):
    super().__init__()
    self.now = dict.fromkeys(HELD + MADE, 0)
    self.peak, self.at_peak = 0, dict(self.now)
    self._seen = WeakIdKeyDictionary()     # storage -> [bytes, category, weak reference]

  @property
  def total(self) -> int:
    return sum(self.now.values())

  def hold(self, tensors, category):
    """Count `tensors` (made before, or outside, the mode) as `category`; ones already counted
    move to it."""
    for t in tensors:
      self._add(t.untyped_storage(), category)

  def restart_peak(self):
    """The peak from now on (e.g. the second step, with the first's lazily made state held)."""
    self.peak, self.at_peak = self.total, dict(self.now)

  def _add(self, storage, category):
    entry = self._seen.get(storage)
    if entry is not None:
      if entry[1] != category:
        self.now[entry[1]] -= entry[0]
        self.now[category] += entry[0]
        entry[1] = category
      return
    entry = [storage.nbytes(), category, None]
    entry[2] = weakref.ref(storage, lambda _, e=entry: self._drop(e))
    self._seen[storage] = entry
    self.now[category] += entry[0]

  def _drop(self, entry):
    self.now[entry[1]] -= entry[0]

  def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    out = func(*args, **(kwargs or {}))
    made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if made:
      category = 'backward' if in_backward() else 'forward' if torch.is_grad_enabled() else 'update'
      for t in made:
        storage = t.untyped_storage()
        if storage not in self._seen:
          self._add(storage, category)
      total = self.total
      if total > self.peak:
        self.peak, self.at_peak = total, dict(self.now)
    return out


def tensors_in(obj, depth=6, seen=None):
  """The tensors reachable from `obj` through dicts, lists, tuples, sets and objects' fields."""
  seen = set() if seen is None else seen
  if id(obj) in seen or depth < 0:
    return []
  seen.add(id(obj))
  if isinstance(obj, torch.Tensor):
    return [obj]
  if isinstance(obj, dict):
    items = list(obj.keys()) + list(obj.values())
  elif isinstance(obj, (list, tuple, set, frozenset)):
    items = list(obj)
  elif hasattr(obj, '__dict__') and not isinstance(obj, type):
    items = list(vars(obj).values())
  else:
    return []
  return [t for item in items for t in tensors_in(item, depth - 1, seen)]
