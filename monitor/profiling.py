"""A window of training steps recorded with torch.profiler (config section `profiling`):

    --config.profiling.start_step=5 --config.profiling.num_steps=2 --config.profiling.ranks='(0, 1)'

records steps 5 and 6 on ranks 0 and 1 (CPU activity; CUDA kernels too on CUDA; shapes, memory and
Python stacks where asked) into <workdir>/profile/rank<R>.steps<A>-<B>.pt.trace.json: a Chrome trace
that chrome://tracing, Perfetto and TensorBoard's profile plugin open, each step a `train step N`
span. On CUDA, `cuda_memory_snapshot` also records the allocator's history over the window and
writes its snapshot at the window's end (rank<R>.steps<A>-<B>.memory.pickle, for
pytorch.org/memory_viz): put the window on the step whose peak you want to see.

NxD Training has no profiler keys of its own (NeMo's nsys_profile is NVIDIA's and refused there);
TorchTitan's [profiling] section is the model of this one.
"""
import os

import torch
from absl import logging

from config_checks import positive


def check(config, world_size=1) -> list:
  p, problems = config.profiling, []
  if p.start_step < 0:
    problems.append(f'profiling.start_step={p.start_step}: give the first step to record (counted from 1), or 0 (off)')
  if not p.start_step:
    return problems
  positive(problems, 'profiling.num_steps', p.num_steps)
  outside = [r for r in tuple(p.ranks) if not 0 <= r < world_size]
  if outside:
    problems.append(f'profiling.ranks={tuple(p.ranks)}: {outside} not among the run\'s {world_size} rank(s) '
                    f'(0..{world_size - 1}); () records every rank')
  if p.start_step > config.trainer.max_steps:
    problems.append(f'profiling.start_step={p.start_step} is after the run\'s last step (trainer.max_steps='
                    f'{config.trainer.max_steps}): nothing would be recorded')
  if config.device == 'xla':
    problems.append("profiling.start_step > 0 with device='xla': torch.profiler sees only the host side of an XLA "
                    'step; use torch_xla.debug.profiler (its own trace server) and set profiling.start_step=0')
  if p.cuda_memory_snapshot and config.device not in ('cuda', 'auto'):
    problems.append(f'profiling.cuda_memory_snapshot=True with device={config.device!r}: the snapshot is CUDA\'s '
                    'allocator history; set it False')
  return problems


class Window:
  """This rank's profiled window: `before(n)` / `after(n)` around training step n (counted from 1)."""

  def __init__(self, config, workdir, rank, device):
    p = config.profiling
    self.on = p.start_step > 0 and (not p.ranks or rank in tuple(p.ranks))
    self.first, self.last = p.start_step, p.start_step + p.num_steps - 1
    self.settings, self.device, self.profiler, self.span = p, device, None, None
    self.snapshot = bool(p.cuda_memory_snapshot) and device.type == 'cuda'
    self.path = os.path.join(workdir, 'profile', f'rank{rank}.steps{self.first}-{self.last}')

  def before(self, n):
    if self.profiler is not None:
      self._mark(n)
    if not self.on or n != self.first:
      return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if self.device.type == 'cuda':
      activities.append(torch.profiler.ProfilerActivity.CUDA)
    p = self.settings
    self.profiler = torch.profiler.profile(activities=activities, record_shapes=p.record_shapes,
                                           profile_memory=p.profile_memory, with_stack=p.with_stack)
    if self.snapshot:
      torch.cuda.memory._record_memory_history(max_entries=p.snapshot_entries)  # pylint: disable=protected-access
    self.profiler.start()
    self._mark(n)

  def _mark(self, n):
    self.span = torch.profiler.record_function(f'train step {n}')
    self.span.__enter__()

  def after(self, n):
    if self.profiler is None:
      return
    self.span.__exit__(None, None, None)
    if n >= self.last:
      self.close()

  def close(self):
    """Stop and write what was recorded (at the window's end, or where the run ended inside it)."""
    if self.profiler is None:
      return
    if self.device.type == 'cuda':
      torch.cuda.synchronize()           # the window's kernels finish inside it
    profiler, self.profiler = self.profiler, None
    profiler.stop()
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    profiler.export_chrome_trace(self.path + '.pt.trace.json')
    written = [self.path + '.pt.trace.json']
    if self.snapshot:
      torch.cuda.memory._dump_snapshot(self.path + '.memory.pickle')  # pylint: disable=protected-access
      torch.cuda.memory._record_memory_history(enabled=None)  # pylint: disable=protected-access
      written.append(self.path + '.memory.pickle')
    logging.info('profile of steps %d-%d: %s', self.first, self.last, ', '.join(written))
