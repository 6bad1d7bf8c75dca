"""Stop requests: SIGTERM (a cluster's preemption notice) and Ctrl-C, agreed on by all ranks.

The signal handler is the only writer of `requested`; the agreement across ranks reads it and
keeps its answer in `agreed`. A handler that runs between the read and the agreement (Python
runs handlers between bytecodes) therefore cannot be overwritten: its request is seen at the
next step's agreement. A second Ctrl-C raises KeyboardInterrupt at once (no save).
"""
import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class StopSignals:

  def __init__(self, install=True):
    self.requested = None    # name of the first signal received; written only by the handler
    self.agreed = None       # the reason all ranks agreed to stop for, or None
    self._previous = {}
    if install:
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self.handle)

  def handle(self, signum, frame):  # pylint: disable=unused-argument
    name = signal.Signals(signum).name
    if signum == signal.SIGINT and self.requested is not None:
      raise KeyboardInterrupt('second Ctrl-C')
    if self.requested is None:
      self.requested = name
      action = ' (press Ctrl-C again to exit at once, without saving)' if signum == signal.SIGINT else ''
      log.warning('%s: finishing this step, saving a checkpoint, then exiting%s', name, action)

  def agree(self, group=None) -> bool:
    """Whether any rank has a stop request (all ranks get the same answer). Reads the
    handler's flag once and never writes it back."""
    requested = self.requested
    if group is None and not (dist.is_initialized() and dist.get_world_size() > 1):
      if requested is not None:
        self.agreed = requested
      return self.agreed is not None
    flag = torch.tensor([int(requested is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() and self.agreed is None:
      self.agreed = requested or 'a signal on another rank'
    return self.agreed is not None

  def restore(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
