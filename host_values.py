"""Values the host reads off the step's tensors, and what a traced step uses instead.

A traced step (step_trace.py: `--dry_run=trace`) runs the real code on fake tensors,
which have shapes, dtypes and devices but no values. The few places where the step reads a
value on the host (the finite check, the logged scalars) or where a shape depends on values
(dropless MoE's tokens per expert, the ring's block masks) read it through `read` here: on
real tensors it is the value; on fake ones it is the stated assumption, recorded by name so
the trace's report lists every one (nothing is assumed silently).
"""
import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_flatten

# the recorders of the traces running now (a trace is single-threaded; nested ones each see all)
_RECORDERS = []


def tracing() -> bool:
  """Whether a fake-tensor mode is active here (tensors made now are fake)."""
  return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None  # pylint: disable=protected-access


def is_fake(t) -> bool:
  """Whether `t` is a fake tensor (a traced step's: no values)."""
  return isinstance(t, FakeTensor)


def read(t, real, what, assumed):
  """real(t) for a real tensor; for a fake one `assumed` (a value, or a function of nothing),
  with `what` (the value read, and the assumption in words) recorded for the trace's report."""
  if not is_fake(t):
    return real(t)
  note(what)
  return assumed() if callable(assumed) else assumed


def note(what):
  """Record `what` a traced step does differently from the real one (for the trace's report)."""
  for recorder in _RECORDERS:
    recorder[what] = recorder.get(what, 0) + 1


def fake_in(values) -> bool:
  """Whether any tensor among `values` (nested lists, tuples, dicts) is fake."""
  return any(is_fake(t) for t in tree_flatten(values)[0])


def flag(t, what, assumed):
  """bool(t) of a one-element tensor, or `assumed` in a trace."""
  return read(t, bool, what, assumed)


@contextlib.contextmanager
def recording():
  """Collect the assumptions made inside: {what: how many times}."""
  seen = {}
  _RECORDERS.append(seen)
  try:
    yield seen
  finally:
    _RECORDERS.remove(seen)


def host():
  """A context where operations on real host tensors run for real even inside a trace: for
  what the step computes from its layout alone, never from the data (the ring's positions)."""
  return unset_fake_temporarily()


def on_device(t, like):
  """The real host tensor `t` on `like`'s device; in a trace a fake of its shape, dtype and
  bytes on that device (its values are never read there)."""
  if is_fake(like):
    return torch.empty(t.shape, dtype=t.dtype, device=like.device)
  return t.to(like.device, non_blocking=True)


def balanced(total: int, parts: int) -> list:
  """`total` split as evenly as it goes over `parts` (the first ones one larger): the token
  counts a traced step assumes where the routing decides them."""
  return [total // parts + (i < total % parts) for i in range(parts)]


def placeholder(t):
  """What a read of fake `t` gives: nan where it is floating point, else 0; a Python number for
  one element (a real tensor would be made fake again by the trace's mode at its first use)."""
  value = float('nan') if t.dtype.is_floating_point else 0
  if t.dim() == 0:
    return value
  with unset_fake_temporarily():
    return torch.full(t.shape, value, dtype=t.dtype)
