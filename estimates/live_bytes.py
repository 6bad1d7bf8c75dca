"""Live tensor bytes of a traced step, by category, and their peak.

A dispatch mode that sees every tensor an operation creates (real or fake: under
FakeTensorMode a traced step's tensors have sizes but no storage behind them), counts its
storage's bytes from creation until Python drops the last reference (a weak reference's
callback), and keeps the peak of the sum with what each category held then. Tensors made
before the mode (parameters, optimizer state) are added with `hold`, by category.

What the step makes is a transient, unless autograd saves it for the backward (a
saved-tensors hook, `saving`): then it is an activation (the logits' log-probs among them).
"""
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

HELD = ('params', 'master', 'optimizer', 'grads')     # made before the step, kept after it
MADE = ('activations', 'transients')                 # made by the step


class _Counter:
  """The bookkeeping of LiveBytes and FakeLiveBytes: live.peak, live.at_peak ({category:
  bytes} at the peak), live.now; `hold`, `saving`, `restart_peak`."""

  def _start_counting(self):
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

  def resized(self, storage):
    """`storage` (counted) changed size in place (ZeRO-3's gathered and freed parameters)."""
    entry = self._seen.get(storage)
    if entry is not None:
      self.now[entry[1]] += storage.nbytes() - entry[0]
      entry[0] = storage.nbytes()
      total = self.total
      if total > self.peak:
        self.peak, self.at_peak = total, dict(self.now)

  def restart_peak(self):
    """The peak from now on (e.g. the second step, with the first's lazily made state held)."""
    self.peak, self.at_peak = self.total, dict(self.now)

  def saving(self):
    """The context in which what autograd saves for the backward counts as activations."""
    return torch.autograd.graph.saved_tensors_hooks(self._saved, lambda t: t)

  def _saved(self, t):
    if isinstance(t, torch.Tensor):
      entry = self._seen.get(t.untyped_storage())
      if entry is not None and entry[1] == 'transients':
        self._add(t.untyped_storage(), 'activations')
    return t

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

  def _count(self, out):
    """Count the storages an operation's outputs `out` hold that are new, and the peak."""
    made = [out] if isinstance(out, torch.Tensor) else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if made:
      for t in made:
        storage = t.untyped_storage()
        if storage not in self._seen:
          self._add(storage, 'transients')
      total = self.total
      if total > self.peak:
        self.peak, self.at_peak = total, dict(self.now)


class LiveBytes(_Counter, TorchDispatchMode):
  """Counts real tensors' bytes (or, above a FakeTensorMode, fake ones': FakeLiveBytes is faster)."""

  def __init__(self):
    super().__init__()
    self._start_counting()

  def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    out = func(*args, **(kwargs or {}))
    self._count(out)
    return out


class FakeLiveBytes(_Counter, FakeTensorMode):
  """A FakeTensorMode that counts its tensors' bytes: one dispatch mode where LiveBytes above a
  FakeTensorMode is two (each operation's Python dispatch is most of a traced step's time).
  Only the operations the code calls are counted, not those a fake kernel decomposes into (the
  real kernels of the former allocate no such intermediates)."""

  def __init__(self):
    super().__init__()
    self._start_counting()
    self._depth = 0

  def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    self._depth += 1
    try:
      out = super().__torch_dispatch__(func, types, args, kwargs)
    finally:
      self._depth -= 1
    if self._depth == 0:
      self._count(out)
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
