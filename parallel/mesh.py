"""The process mesh: dp x pp x cp x tp ranks (tp fastest) and their process groups, as a value.

Built from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). World
size 1 needs no process group at all: every collective in parallel/comm.py is then skipped.
Groups are passed down explicitly; there is no global state beyond torch.distributed's own.

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

cp (context parallelism, parallel/context.py) sits next to tp, so a sequence's ring stays on
close ranks; cp = 1 gives the dp x pp x tp numbering unchanged.

Expert parallelism (MoE) is carved from data parallel, as Megatron does: ep consecutive DP
ranks form an `ep` group (each holds 1/ep of the experts, and tokens are exchanged within it);
the DP ranks holding the same experts (dp_rank % ep alike) form the `expert_dp` group that
sums those experts' gradients. Dense parameters still reduce over the whole DP group.

Hybrid sharding (HSDP, distributed_strategy.data_parallel_shard_size = S < dp x cp): ZeRO's
shards span S consecutive dp x cp ranks (a `shard` group) and the dp x cp / S shard groups are
replicas of each other (a `replicate` group: the ranks holding the same shard).
"""
import dataclasses
import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from config_checks import positive
from parallel import device as devices, xla

# distributed_strategy's degrees: every other layout check divides by them.
SIZE_KEYS = ('tensor_model_parallel_size', 'pipeline_model_parallel_size',
             'virtual_pipeline_model_parallel_size', 'kv_replicator', 'context_parallel_size',
             'expert_model_parallel_size')


@dataclasses.dataclass(frozen=True)
class Mesh:
  dp: int = 1
  pp: int = 1
  tp: int = 1
  rank: int = 0
  device: torch.device = torch.device('cpu')
  kv_replicator: int = 1
  dp_group: Optional[object] = None
  pp_group: Optional[object] = None
  tp_group: Optional[object] = None
  kv_group: Optional[object] = None      # TP ranks holding copies of the same KV head
  embed_group: Optional[object] = None   # first and last PP stage (tied embedding copies)
  host_group: Optional[object] = None    # gloo over all ranks, CPU tensors, main thread only:
                                         # agreements (stop signals, start-up checks)
  timeout_s: float = 300.0
  cp: int = 1
  cp_group: Optional[object] = None      # the ranks holding slices of the same sequences (the ring)
  dp_cp_group: Optional[object] = None   # dp x cp: where weight gradients, loss sums and ZeRO-1
                                         # shards are reduced (the cp ranks saw parts of one batch)
  ep: int = 1                            # expert parallel degree (divides dp)
  ep_group: Optional[object] = None      # the ep consecutive DP ranks sharing out the experts
  expert_dp_group: Optional[object] = None  # DP ranks holding the same experts
  dp_shard: int = 0                      # HSDP: dp x cp ranks per ZeRO shard group (0: all of them)
  shard_group: Optional[object] = None   # the dp x cp ranks ZeRO shards dense parameters over
  replicate_group: Optional[object] = None  # HSDP: the ranks holding the same shard (None: one group)

  @property
  def world_size(self):
    return self.dp * self.pp * self.cp * self.tp

  @property
  def tp_rank(self):
    return self.rank % self.tp

  @property
  def cp_rank(self):
    return self.rank // self.tp % self.cp

  @property
  def pp_rank(self):
    return self.rank // (self.tp * self.cp) % self.pp

  @property
  def dp_rank(self):
    return self.rank // (self.tp * self.cp * self.pp)

  @property
  def dp_cp(self):
    return self.dp * self.cp

  @property
  def dp_cp_rank(self):
    """This rank's place in dp_cp_group (ranks in increasing order: dp major, cp minor)."""
    return self.dp_rank * self.cp + self.cp_rank

  @property
  def shard_size(self):
    return self.dp_shard or self.dp_cp

  @property
  def shard_rank(self):
    """This rank's place in shard_group."""
    return self.dp_cp_rank % self.shard_size

  @property
  def ep_rank(self):
    return self.dp_rank % self.ep

  @property
  def expert_dp(self):
    return self.dp // self.ep

  @property
  def expert_dp_rank(self):
    return self.dp_rank // self.ep

  def rank_of(self, dp_rank=0, pp_rank=0, tp_rank=0, cp_rank=0):
    return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

  def describe(self):
    cp = f' cp {self.cp_rank}/{self.cp}' if self.cp > 1 else ''
    ep = f' ep {self.ep_rank}/{self.ep}' if self.ep > 1 else ''
    return (f'rank {self.rank}/{self.world_size} = dp {self.dp_rank}/{self.dp} pp {self.pp_rank}/{self.pp}{cp} '
            f'tp {self.tp_rank}/{self.tp}{ep}')


def check_sizes(strategy) -> list:
  """Problems with the degrees in SIZE_KEYS (distributed_strategy); none means all are > 0."""
  problems = []
  for key in SIZE_KEYS:
    positive(problems, f'distributed_strategy.{key}', strategy[key])
  return problems


def check(strategy, world_size) -> list:
  """Whether `world_size` processes make a dp x pp x cp x tp grid (degrees already checked)."""
  tp, pp = strategy.tensor_model_parallel_size, strategy.pipeline_model_parallel_size
  cp = strategy.context_parallel_size
  if world_size % (tp * pp * cp):
    return [f'world size {world_size} is not divisible by tensor_model_parallel_size x '
            f'pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp}; launch a multiple '
            f'of {tp * pp * cp} processes']
  ep, dp = strategy.get('expert_model_parallel_size', 1), world_size // (tp * pp * cp)
  if dp % ep:
    return [f'distributed_strategy.expert_model_parallel_size={ep} must divide the data-parallel degree '
            f'{dp} (experts are sharded over DP ranks); launch a multiple of {tp * pp * cp * ep}']
  shard = strategy.get('data_parallel_shard_size', 0)
  if shard and (shard < 0 or (dp * cp) % shard):
    return [f'distributed_strategy.data_parallel_shard_size={shard} must divide dp x cp = {dp} x {cp} (HSDP: '
            'ZeRO shards over groups of that many ranks, replicated across the groups); 0 shards over all of them']
  if shard and not strategy.zero1:
    return [f'distributed_strategy.data_parallel_shard_size={shard} is read only with zero1=True (nothing is '
            'sharded without it); set zero1=True, or data_parallel_shard_size=0']
  return []


def _groups(grid, rank, make_group):
  """Every rank creates every group in the same order (torch.distributed requires it)."""
  mine = {}
  coords = [(d, p, t, c) for d in range(grid.dp) for p in range(grid.pp) for c in range(grid.cp)
            for t in range(grid.tp)]
  dp_cp = [(p, t, [grid.rank_of(d, p, t, c) for d in range(grid.dp) for c in range(grid.cp)])
           for p in range(grid.pp) for t in range(grid.tp)]
  families = {
      'tp': {(d, p, c): [grid.rank_of(d, p, t, c) for t in range(grid.tp)] for d, p, _, c in coords},
      'pp': {(d, t, c): [grid.rank_of(d, p, t, c) for p in range(grid.pp)] for d, _, t, c in coords},
      'dp': {(p, t, c): [grid.rank_of(d, p, t, c) for d in range(grid.dp)] for _, p, t, c in coords},
      # TP ranks holding copies of one KV head: consecutive runs of kv_replicator TP ranks
      'kv': {(d, p, t // grid.kv_replicator, c): [grid.rank_of(d, p, t - t % grid.kv_replicator + k, c)
                                                  for k in range(grid.kv_replicator)]
             for d, p, t, c in coords} if grid.kv_replicator > 1 else {},
      # first and last PP stage: the copies of a tied embedding
      'embed': {(d, t, c): [grid.rank_of(d, 0, t, c), grid.rank_of(d, grid.pp - 1, t, c)]
                for d, _, t, c in coords} if grid.pp > 1 else {},
      'cp': {(d, p, t): [grid.rank_of(d, p, t, c) for c in range(grid.cp)]
             for d, p, t, _ in coords} if grid.cp > 1 else {},
      'dp_cp': {(p, t): [grid.rank_of(d, p, t, c) for d in range(grid.dp) for c in range(grid.cp)]
                for _, p, t, _ in coords} if grid.cp > 1 else {},
      # HSDP: consecutive runs of dp_shard dp x cp ranks, and the ranks at the same place in each
      'shard': {(p, t, j // grid.shard_size): members[j - j % grid.shard_size:][:grid.shard_size]
                for p, t, members in dp_cp for j in range(len(members))} if grid.shard_size < grid.dp_cp else {},
      'replicate': {(p, t, j % grid.shard_size): members[j % grid.shard_size::grid.shard_size]
                    for p, t, members in dp_cp for j in range(len(members))} if grid.shard_size < grid.dp_cp else {},
      # expert parallelism: ep consecutive DP ranks, and the DP ranks holding the same experts
      'ep': {(d // grid.ep, p, t, c): [grid.rank_of(d - d % grid.ep + k, p, t, c) for k in range(grid.ep)]
             for d, p, t, c in coords} if grid.ep > 1 else {},
      'expert_dp': {(d % grid.ep, p, t, c): [grid.rank_of(k * grid.ep + d % grid.ep, p, t, c)
                                             for k in range(grid.dp // grid.ep)]
                    for d, p, t, c in coords} if grid.ep > 1 else {},
  }
  for name, members_by_key in families.items():
    for members in members_by_key.values():
      group = make_group(members)
      if rank in members:
        mine[name] = group
  return mine


def init(config, device_name=None, world=None, rank=None) -> Mesh:
  """The mesh for this process, initializing torch.distributed when the world has more than one
  rank (`world`, `rank`: default torchrun's WORLD_SIZE and RANK) with config.backend's
  process-group backend (devices.backend: the device's own by default)."""
  d = config.distributed_strategy
  world = int(os.environ.get('WORLD_SIZE', '1')) if world is None else world
  rank = int(os.environ.get('RANK', '0')) if rank is None else rank
  device = devices.resolve(device_name or config.device, int(os.environ.get('LOCAL_RANK', '0')))
  tp, pp, cp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.context_parallel_size
  if world % (tp * pp * cp):
    raise ValueError(f'world size {world} is not divisible by tp x pp x cp = {tp} x {pp} x {cp}')
  dp = world // (tp * pp * cp)
  kv_replicator = d.kv_replicator
  ep = d.get('expert_model_parallel_size', 1)
  if dp % ep:
    raise ValueError(f'expert_model_parallel_size={ep} does not divide the data-parallel degree {dp}')
  if world == 1:
    return Mesh(device=device, kv_replicator=kv_replicator, timeout_s=d.collective_timeout_s)
  timeout = datetime.timedelta(seconds=d.collective_timeout_s)
  backend = devices.backend(device, config.get('backend', 'auto'))
  if not dist.is_initialized():
    if backend == 'xla':
      xla.init_process_group(timeout)         # torchrun's env; the `xla` backend's collectives
    else:
      dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=_store(backend))
  # Every group gets the timeout: new_group's default is 30 minutes, not the default group's.
  make_group = lambda ranks: dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
  shard = d.get('data_parallel_shard_size', 0)
  groups = _groups(Mesh(dp=dp, pp=pp, tp=tp, cp=cp, kv_replicator=kv_replicator, ep=ep, dp_shard=shard), rank,
                   make_group)
  dp_cp_group = groups.get('dp_cp', groups.get('dp'))
  return Mesh(dp=dp, pp=pp, tp=tp, cp=cp, rank=rank, device=device, kv_replicator=kv_replicator,
              cp_group=groups.get('cp'), dp_cp_group=dp_cp_group, dp_shard=shard,
              shard_group=groups.get('shard', dp_cp_group), replicate_group=groups.get('replicate'),
              ep=ep, ep_group=groups.get('ep'), expert_dp_group=groups.get('expert_dp'),
              dp_group=groups.get('dp'), pp_group=groups.get('pp'), tp_group=groups.get('tp'),
              kv_group=groups.get('kv'), embed_group=groups.get('embed'), timeout_s=d.collective_timeout_s,
              host_group=dist.new_group(backend=devices.host_backend(backend), timeout=timeout))


def _store(backend):
  """The fake backend (one rank of any world, collectives that return at once: the traced dry
  run) needs no rendezvous; the others meet at torchrun's MASTER_ADDR / MASTER_PORT."""
  if backend != 'fake':
    return None
  from torch.testing._internal.distributed import fake_pg  # pylint: disable=import-outside-toplevel
  return fake_pg.FakeStore()


def layout(config, world_size, rank=0) -> Mesh:
  """`config`'s layout at `world_size` ranks as rank `rank` holds it: its coordinates and
  degrees, no process group (what a plan or a trace asks of a rank not started)."""
  d = config.distributed_strategy
  tp, pp, cp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.context_parallel_size
  return Mesh(dp=world_size // (tp * pp * cp), pp=pp, tp=tp, cp=cp, kv_replicator=d.kv_replicator,
              ep=d.get('expert_model_parallel_size', 1), rank=rank, dp_shard=d.get('data_parallel_shard_size', 0))


def shutdown():
  if dist.is_initialized():
    dist.destroy_process_group()
