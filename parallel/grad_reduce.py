"""The data-parallel reduction of a gradient bucket: which collective (`zero1_collectives`), and
gloo's point-to-point reduce-scatter; the checks of the strategy's reduction keys."""
import torch
import torch.distributed as dist

from config_checks import one_of

COLLECTIVES = ('auto', 'reduce_scatter', 'all_reduce')
TAGS = 1 << 20      # point-to-point tags of the gradient buckets, apart from the gather's (zero.py)


def resolved(choice):
  """`zero1_collectives` resolved: auto is the reduce-scatter on every backend (gloo's point to point)."""
  return 'reduce_scatter' if choice == 'auto' else choice


class PointToPoint:
  """A bucket's reduce-scatter on gloo, point to point (gloo's reduce_scatter_tensor stages a
  full-size copy and ran 2-10x slower than this): part k of `data` ([parts, S]) is sent to rank
  k, the others' copies of this rank's part are received, and `wait` adds them into it in rank
  order ((c0 + c1) + c2 ...: the same sum on every layout of the same dp)."""

  def __init__(self, data, index, group, tag):
    self.data, self.index = data, index
    ranks = dist.get_process_group_ranks(group)
    peers = [q for q in range(data.shape[0]) if q != index]
    self.received = torch.empty(len(peers), data.shape[1], dtype=data.dtype, device=data.device)
    self.works = []
    for j, q in enumerate(peers):
      self.works.append(dist.isend(data[q], ranks[q], group=group, tag=tag))
      self.works.append(dist.irecv(self.received[j], ranks[q], group=group, tag=tag))

  def wait(self):
    if self.received is None:
      return
    for work in self.works:
      work.wait()
    mine, received = self.data[self.index], self.received
    if self.index > 0:
      before = received[0]
      for c in received[1:self.index]:
        before.add_(c)
      mine.add_(before)
    for c in received[self.index:]:
      mine.add_(c)
    self.received, self.works = None, []


STAGES = (1, 2, 3)    # ZeRO's: the optimizer state and masters sharded; also the gradients; also the parameters


def check(strategy) -> list:
  """distributed_strategy.zero1_collectives, zero_stage and overlap_param_gather (the overlaps
  are bools: ConfigDict keeps their type)."""
  problems = []
  stage = strategy.get('zero_stage', 1)
  if stage not in STAGES:
    problems.append(f'distributed_strategy.zero_stage={stage!r} is not one of {STAGES} (1: optimizer state and '
                    'master weights sharded over DP, 2: the gradients too, 3: the parameters too)')
  elif stage != 1 and not strategy.zero1:
    problems.append(f'distributed_strategy.zero_stage={stage} is read only with distributed_strategy.zero1=True '
                    '(zero1 is False: nothing is sharded); set zero1=True, or zero_stage=1')
  for key in ('reshard_after_forward', 'reshard_after_backward'):
    if not strategy.get(key, True) and stage != 3:
      problems.append(f'distributed_strategy.{key}=False is read only with zero_stage=3 (the parameters are not '
                      f'sharded at zero_stage={stage}); set zero_stage=3 or {key}=True')
  if not strategy.get('grad_reduce_per_micro_batch', True) and stage != 3:
    problems.append('distributed_strategy.grad_reduce_per_micro_batch=False is read only with zero_stage=3 (at '
                    f'zero_stage={stage} whole gradients through the step are ZeRO-1); set zero_stage=3, or '
                    'zero_stage=1 for whole gradients')
  one_of(problems, 'distributed_strategy.zero1_collectives', strategy.zero1_collectives, COLLECTIVES)
  if strategy.zero1_collectives != 'auto' and not strategy.zero1:
    problems.append(f'distributed_strategy.zero1_collectives={strategy.zero1_collectives!r} is read only with '
                    'distributed_strategy.zero1=True (zero1 is False: plain DP always all-reduces); set zero1=True '
                    "or zero1_collectives='auto'")
  if not strategy.get('overlap_param_gather', True) and not strategy.zero1:
    problems.append('distributed_strategy.overlap_param_gather=False is read only with distributed_strategy.zero1=True '
                    '(zero1 is False: plain DP gathers no parameters); set zero1=True or overlap_param_gather=True')
  return problems
