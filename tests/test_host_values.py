"""host_values.py: the values a step reads on the host, and the assumptions a trace makes instead."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import host_values


def test_real_tensors_are_read_and_fake_ones_assumed_by_name():
  real = torch.tensor([1, 0, 3])
  with host_values.recording() as assumed:
    assert host_values.read(real, lambda t: t.tolist(), 'the counts', [9]) == [1, 0, 3]
    assert assumed == {}
    with FakeTensorMode():
      fake = torch.ones(3)
      assert host_values.tracing() and host_values.is_fake(fake) and not host_values.is_fake(real)
      assert host_values.read(fake, lambda t: t.tolist(), 'the counts (even)', lambda: [1, 1, 1]) == [1, 1, 1]
      assert host_values.flag(fake.sum() > 0, 'the check (passes)', True) is True
    assert not host_values.tracing()
  assert assumed == {'the counts (even)': 1, 'the check (passes)': 1}


def test_a_fake_read_gives_nan_or_zero_and_nothing_is_recorded_outside_a_recording():
  with FakeTensorMode():
    loss, count, rows = torch.ones(()), torch.ones((), dtype=torch.int64), torch.ones(2, 2)
  assert torch.isnan(torch.tensor(host_values.placeholder(loss))) and host_values.placeholder(count) == 0
  grid = host_values.placeholder(rows)
  assert not host_values.is_fake(grid) and grid.shape == (2, 2) and torch.isnan(grid).all()
  assert host_values.fake_in({'a': [loss]}) and not host_values.fake_in([torch.ones(1)])
  host_values.note('outside any trace')       # no recorder: nothing kept, nothing raised


def test_balanced_splits_a_total_as_evenly_as_it_goes():
  assert host_values.balanced(10, 4) == [3, 3, 2, 2] and sum(host_values.balanced(7, 7)) == 7


def test_the_layouts_host_tensors_compute_for_real_in_a_trace_and_reach_it_as_fakes():
  with FakeTensorMode():
    like = torch.ones(2)
    with host_values.host():
      positions = torch.arange(4)
      causal = positions[None, :] <= positions[:, None]
      assert not host_values.is_fake(causal) and int(causal.sum()) == 10
    moved = host_values.on_device(causal, like)
    assert host_values.is_fake(moved) and moved.shape == (4, 4) and moved.dtype == torch.bool
  assert host_values.on_device(causal, torch.ones(1)) is causal     # real: the tensor itself, same device
