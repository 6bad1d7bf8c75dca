"""Each collective's forward and backward against its definition, on a 2-rank gloo world."""
import datetime

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from tests import world

WORLD = 2


def _all_inputs(shape, seed):
  """Every rank's input, drawn identically everywhere so each rank can compute the definition."""
  g = torch.Generator().manual_seed(seed)
  return [torch.randn(shape, generator=g) for _ in range(WORLD)]


def _check_pairs():
  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))
  r, group = dist.get_rank(), dist.group.WORLD
  xs = _all_inputs((2, 4, 3), 0)         # [b, s, h] per rank
  ups = _all_inputs((2, 4, 3), 1)        # upstream gradients per rank (same shape as full outputs)
  ups_gathered = _all_inputs((2, 8, 3), 2)
  ups_scattered = _all_inputs((2, 2, 3), 3)
  failures = []

  def run(name, fn, x, up, expect_y, expect_grad):
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(up)
    if not torch.allclose(y, expect_y, atol=1e-6):
      failures.append(f'{name} forward')
    if not torch.allclose(x.grad, expect_grad, atol=1e-6):
      failures.append(f'{name} backward')

  total = sum(xs)
  run('copy_to_group', lambda x: comm.copy_to_group(x, group), xs[r], ups[r], xs[r], sum(ups))
  run('reduce_from_group', lambda x: comm.reduce_from_group(x, group), xs[r], ups[r], total, ups[r])
  run('gather_seq', lambda x: comm.gather_seq(x, group), xs[r], ups_gathered[r], torch.cat(xs, 1),
      sum(ups_gathered).chunk(WORLD, 1)[r])
  run('reduce_scatter_seq', lambda x: comm.reduce_scatter_seq(x, group), xs[r], ups_scattered[r],
      total.chunk(WORLD, 1)[r], torch.cat(ups_scattered, 1))
  run('split_seq', lambda x: comm.split_seq(x, group), xs[0], ups_scattered[r], xs[0].chunk(WORLD, 1)[r],
      torch.cat(ups_scattered, 1))
  return failures


def test_conjugate_pairs_match_their_definitions():
  assert world.run(_check_pairs, WORLD) == [[], []]


def _hang(timeout_s):
  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=timeout_s))
  if dist.get_rank() == 1:
    return 'skipped the collective'
  comm.all_reduce_(torch.ones(3), dist.group.WORLD, name='all_reduce(test)')
  return 'unreachable'


def test_a_hang_fails_naming_the_rank_and_the_operation():
  with pytest.raises(RuntimeError, match=r'rank 0: all_reduce\(test\) over ranks \[0, 1\] failed'):
    world.run(_hang, WORLD, 3)


def test_group_of_one_is_the_identity():
  x = torch.randn(2, 3, requires_grad=True)
  for fn in (comm.copy_to_group, comm.reduce_from_group, comm.gather_seq, comm.split_seq):
    assert fn(x, None) is x
  assert comm.group_size(None) == 1 and comm.group_rank(None) == 0


def _one_rank_fails():
  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))
  rank = dist.get_rank()

  def check():
    if rank == 1:
      raise ValueError('bad input on rank 1')
    return 'ok'
  try:
    return comm.on_every_rank(check, dist.group.WORLD, 'the start-up check')
  except Exception as e:  # pylint: disable=broad-except
    return f'{type(e).__name__}: {e}'


def test_an_error_on_one_rank_is_raised_on_every_rank():
  assert world.run(_one_rank_fails, WORLD) == [
      'PeerError: the start-up check failed on rank(s) [1]; see the error printed there',
      'ValueError: bad input on rank 1']
