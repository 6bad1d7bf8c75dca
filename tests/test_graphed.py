"""optim/graphed.py: launched directly once, captured the second time, replayed after; keyed
by every tensor's place. The capture itself is CUDA's (checked on a GPU by tools/gpu_bench.sh);
here a stand-in graph replays the recorded launch on the buffers it was captured with."""
import pytest
import torch

from optim import graphed


class _Replay:

  def __init__(self, launch, buffers):
    self.launch, self.buffers, self.replays = launch, buffers, 0

  def replay(self):
    self.replays += 1
    self.launch(*self.buffers)


@pytest.fixture(name='captures')
def _fake_cuda(monkeypatch):
  captures = []

  def capture(launch, inputs):
    buffers = [None if t is None else t.clone() for t in inputs]
    captures.append(_Replay(launch, buffers))
    return captures[-1], buffers

  monkeypatch.setattr(graphed, 'usable', lambda inputs: graphed.ENABLED)
  monkeypatch.setattr(graphed, '_capture', capture)
  graphed.clear()
  yield captures
  graphed.clear()


def _axpy(param):
  """A launch that adds its input (times 2) to `param` in place; counts its direct calls."""
  calls = []

  def launch(x, unused):
    calls.append(x)
    param.add_(2 * x)
  return launch, calls


def test_direct_then_captured_then_replayed_with_each_steps_inputs(captures):
  param = torch.zeros(3)
  launch, calls = _axpy(param)
  for step in range(1, 5):
    graphed.run(launch, [param], [torch.full((3,), float(step)), None])
  # step 1 direct; step 2 captured (recorded, not run) then replayed; steps 3, 4 replayed
  assert len(captures) == 1 and captures[0].replays == 3
  assert len(calls) == 4 and calls[0] is not captures[0].buffers[0]
  torch.testing.assert_close(param, torch.full((3,), 2.0 * (1 + 2 + 3 + 4)))


def test_a_moved_tensor_or_a_new_input_shape_is_a_new_graph(captures):
  param = torch.zeros(3)
  launch, _ = _axpy(param)
  for _ in range(3):
    graphed.run(launch, [param], [torch.ones(3), None])
  other = torch.zeros(3)
  moved, _ = _axpy(other)
  graphed.run(moved, [other], [torch.ones(3), None])     # launched directly: nothing captured
  assert len(captures) == 1 and other.tolist() == [2.0] * 3
  graphed.run(moved, [other], [torch.ones(3), None])
  assert len(captures) == 2 and other.tolist() == [4.0] * 3
  graphed.run(launch, [param], [torch.ones(1), None])     # another input shape: direct again
  assert len(captures) == 2 and param.tolist() == [8.0] * 3


def test_off_the_calls_always_run_directly(captures, monkeypatch):
  monkeypatch.setattr(graphed, 'ENABLED', False)
  param = torch.zeros(2)
  launch, calls = _axpy(param)
  for _ in range(3):
    graphed.run(launch, [param], [torch.ones(2), None])
  assert not captures and len(calls) == 3


def test_on_the_cpu_nothing_is_captured():
  assert not graphed.usable([torch.ones(2), None]) and not graphed.usable([None])


def test_a_failed_capture_warns_and_the_calls_run_directly_from_then_on(captures, monkeypatch, caplog):
  monkeypatch.setattr(graphed, 'ENABLED', True)          # restored after: the failure turns it off

  def fail(launch, inputs):
    raise RuntimeError('operation not permitted when stream is capturing')

  monkeypatch.setattr(graphed, '_capture', fail)
  param = torch.zeros(2)
  launch, calls = _axpy(param)
  for _ in range(4):
    graphed.run(launch, [param], [torch.ones(2), None])
  assert len(calls) == 4 and param.tolist() == [8.0, 8.0]
  assert 'capture of the update failed (RuntimeError: operation not permitted' in caplog.text
  assert not graphed.ENABLED and not captures
