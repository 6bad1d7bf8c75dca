"""parallel/grad_reduce.py: gloo's point-to-point reduce-scatter adds in rank order, and the
reduction keys are refused by name where they are unknown or not read."""
import torch

from configs import validate
from parallel import grad_reduce
from tests import parity, world


def _config(collective='auto'):
  config = parity.parity_config(tied=True)
  config.distributed_strategy.zero1_collectives = collective
  return config


def test_an_unknown_zero1_collective_is_named():
  config = _config()
  config.distributed_strategy.zero1_collectives = 'ring'
  problems = validate.check(config)
  assert any(p.startswith("distributed_strategy.zero1_collectives='ring' is unknown") for p in problems), problems


def test_a_zero1_collective_without_zero1_is_refused_with_both_keys():
  config = _config(collective='reduce_scatter')          # zero1 is False
  problems = validate.check(config)
  assert any("zero1_collectives='reduce_scatter' is read only with distributed_strategy.zero1=True" in p
             for p in problems), problems


def test_param_gather_overlap_off_without_zero1_is_refused_with_both_keys():
  config = _config()                                      # zero1 is False
  config.distributed_strategy.overlap_param_gather = False
  problems = validate.check(config)
  assert any('overlap_param_gather=False is read only with distributed_strategy.zero1=True' in p
             for p in problems), problems
  config.distributed_strategy.zero1 = True
  assert not validate.check(config)


CONTRIBUTIONS = (1e8, -1e8, 1.0)   # in fp32 (c0 + c1) + c2 = 1, while c0 + (c1 + c2) = (c2 + c0) + c1 = 0


def _point_to_point_sum():
  torch.distributed.init_process_group('gloo')
  rank = torch.distributed.get_rank()
  data = torch.tensor([[CONTRIBUTIONS[rank] * 2.0 ** k] * 2 for k in range(3)])    # [parts, S]: part k
  grad_reduce.PointToPoint(data, rank, torch.distributed.group.WORLD, tag=7).wait()
  return data[rank]


def test_point_to_point_reduce_scatter_adds_in_rank_order():
  """gloo's ZeRO-1 reduce-scatter: each rank's part summed over ranks in rank order, whichever rank owns it."""
  for k, got in enumerate(world.run(_point_to_point_sum, 3)):
    c = [torch.tensor([v * 2.0 ** k] * 2) for v in CONTRIBUTIONS]
    torch.testing.assert_close(got, (c[0] + c[1]) + c[2], rtol=0, atol=0)
    assert got.sum() == 2.0 ** (k + 1) and (c[0] + (c[1] + c[2])).sum() == ((c[2] + c[0]) + c[1]).sum() == 0
