"""parallel/mesh.py: rank arithmetic of the groups, and every group's collective timeout."""
import os
import signal

import pytest
import torch

from parallel import comm, mesh as meshes
from tests import parity, world


def test_rank_of_is_the_inverse_of_the_coordinates():
  mesh = meshes.Mesh(dp=2, pp=3, tp=2)
  for rank in range(mesh.world_size):
    m = meshes.Mesh(dp=2, pp=3, tp=2, rank=rank)
    assert m.rank_of(m.dp_rank, m.pp_rank, m.tp_rank) == rank


def test_hsdp_shard_groups_are_consecutive_dp_cp_ranks_and_replicas_their_strides():
  made = []
  grid = meshes.Mesh(dp=4, tp=2, cp=2, dp_shard=4)          # dp x cp = 8 per tp rank: 2 shard groups of 4
  mine = meshes._groups(grid, 0, lambda ranks: made.append(ranks) or tuple(ranks))  # pylint: disable=protected-access
  dp_cp = [grid.rank_of(d, 0, 0, c) for d in range(4) for c in range(2)]      # tp rank 0, in dp_cp_rank order
  assert mine['shard'] == tuple(dp_cp[:4]) and mine['replicate'] == (dp_cp[0], dp_cp[4])
  assert dp_cp[:4] in made and dp_cp[4:] in made and all(dp_cp[j::4] in made for j in range(4))
  for rank in range(grid.world_size):
    m = meshes.Mesh(dp=4, tp=2, cp=2, dp_shard=4, rank=rank)
    assert m.shard_rank == m.dp_cp_rank % 4 and m.shard_size == 4
  assert meshes.Mesh(dp=4, cp=2).shard_size == 8      # no HSDP: one group of all dp x cp ranks


def _stop_rank_1_then_reduce(timeout_s):
  c = parity.parity_config(tp=2)
  c.distributed_strategy.collective_timeout_s = timeout_s
  mesh = meshes.init(c)
  if mesh.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # a stopped peer (killed by world.run afterwards)
  errors = []
  for name, group in (('tp', mesh.tp_group), ('host', mesh.host_group)):
    try:
      comm.all_reduce_(torch.ones(1), group, name=f'all_reduce({name})')
    except RuntimeError as e:
      errors.append(str(e).splitlines()[0])
  raise RuntimeError(' || '.join(errors))


def test_a_stopped_rank_fails_its_peers_within_the_timeout_naming_rank_and_operation():
  # new_group's own default is 30 minutes: without the timeout on every group this hangs
  # until world.run gives up (a TimeoutError naming ranks [0, 1], not the errors below).
  with pytest.raises(RuntimeError) as error:
    world.run(_stop_rank_1_then_reduce, 2, 3, timeout=90)
  message = str(error.value)
  assert 'rank 0 of 2 failed' in message
  assert 'rank 0: all_reduce(tp) over ranks [0, 1] failed' in message
  assert 'rank 0: all_reduce(host) over ranks [0, 1] failed' in message
