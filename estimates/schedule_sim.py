"""Pipeline schedules simulated: makespan, bubble and activations in flight of the action lists
parallel/pipeline_schedule.py makes (or any others), under blocking batched semantics: a Comm
completes once the peer of each of its ops has posted the matching op. It checks deadlock
freedom, send/recv matching and data dependencies without knowing how the lists were made.
Not used while training: the tests, the docs' bubble table and the planner read it.
"""
import dataclasses
import typing

from parallel.pipeline_schedule import Compute, ScheduleError, make_schedule


@dataclasses.dataclass(frozen=True)
class Simulation:
  makespan: float
  busy: tuple             # compute time per rank
  idle_fraction: float    # idle share of all ranks' wall time
  bubble_ratio: float     # (makespan - busiest rank's compute) / that compute
  peak_in_flight: tuple   # per rank: most (microbatch, chunk) activations held at once


def _transfer(p, v, rank, op):
  """(tensor, microbatch, sender's virtual stage, receiver's virtual stage) of one op."""
  here = op.chunk * p + rank
  there = here + (1 if op.tensor == 'act' else -1) * (1 if op.kind == 'send' else -1)
  if not 0 <= op.chunk < v or not 0 <= there < p * v or there % p != op.peer:
    raise ScheduleError(f'rank {rank}: {op} has no such peer stage (virtual stage {here} '
                        f'-> {there}, which lives on rank {there % p})')
  src, dst = (here, there) if op.kind == 'send' else (there, here)
  return op.tensor, op.microbatch, src, dst


def simulate(p, m, v=1, fwd_cost=1.0, bwd_cost=2.0, comm_cost=0.0, schedules=None):
  """Run all ranks' actions (default: make_schedule's) as one discrete-event simulation.

  A Comm completes comm_cost after the peer of each of its ops has posted the matching op;
  the k-th send from rank a to rank b pairs with the k-th recv on b from a. Raises
  ScheduleError on a deadlock, a mismatched pair or a broken data dependency.
  """
  schedules = schedules or [make_schedule(p, m, v, rank) for rank in range(p)]
  position, clock, busy, peak = [0] * p, [0.0] * p, [0.0] * p, [0] * p
  inbox, in_flight = [set() for _ in range(p)], [set() for _ in range(p)]
  done = set()              # ('F' | 'B', microbatch, virtual stage)
  posted = [None] * p       # a rank's posted Comm: [(peer's channel, index in it, transfer)]
  channels = {}             # (src rank, dst rank, 'send' | 'recv') -> [(transfer, post time)]

  def compute(rank, a):
    vs = a.chunk * p + rank
    if not (0 <= a.chunk < v and 0 <= a.microbatch < m) or (a.kind, a.microbatch, vs) in done:
      raise ScheduleError(f'rank {rank}: {a} is out of range or runs twice')
    if a.kind == 'B' and ('F', a.microbatch, vs) not in done:
      raise ScheduleError(f'rank {rank}: {a} runs before its forward')
    if (vs > 0) if a.kind == 'F' else (vs < p * v - 1):
      needs = ('act' if a.kind == 'F' else 'grad', a.microbatch, vs)
      if needs not in inbox[rank]:
        raise ScheduleError(f'rank {rank}: {a} runs before it received its input {needs}')
      inbox[rank].remove(needs)
    done.add((a.kind, a.microbatch, vs))
    cost = fwd_cost if a.kind == 'F' else bwd_cost
    clock[rank] += cost
    busy[rank] += cost
    (in_flight[rank].add if a.kind == 'F' else in_flight[rank].remove)((a.microbatch, a.chunk))
    peak[rank] = max(peak[rank], len(in_flight[rank]))

  def post(rank, comm):
    posted[rank] = []
    for op in comm.ops:
      transfer = _transfer(p, v, rank, op)
      if op.kind == 'send' and ('F' if op.tensor == 'act' else 'B', *transfer[1:3]) not in done:
        raise ScheduleError(f'rank {rank}: {op} sends a tensor it has not computed yet')
      pair = (rank, op.peer) if op.kind == 'send' else (op.peer, rank)
      queue = channels.setdefault(pair + (op.kind,), [])
      posted[rank].append((pair + ('recv' if op.kind == 'send' else 'send',), len(queue), transfer))
      queue.append((transfer, clock[rank]))

  def unmatched(rank):
    return [op for op, (other, index, _) in zip(schedules[rank][position[rank]].ops, posted[rank])
            if len(channels.get(other, ())) <= index]

  def try_complete(rank):
    if unmatched(rank):
      return False
    for other, index, transfer in posted[rank]:
      peer_transfer, peer_time = channels[other][index]
      if peer_transfer != transfer:
        raise ScheduleError(f'mismatch: message #{index} from rank {other[0]} to rank {other[1]} '
                            f'is {transfer} on rank {rank} but {peer_transfer} on its peer')
      clock[rank] = max(clock[rank], peer_time)
      if other[2] == 'send':                  # this op is the recv
        inbox[rank].add((transfer[0], transfer[1], transfer[3]))
    clock[rank] += comm_cost
    posted[rank] = None
    return True

  progressed = True
  while progressed:
    progressed = False
    for rank in range(p):
      while position[rank] < len(schedules[rank]):
        action = schedules[rank][position[rank]]
        if isinstance(action, Compute):
          compute(rank, action)
        else:
          if posted[rank] is None:
            post(rank, action)
          if not try_complete(rank):
            break
        position[rank] += 1
        progressed = True
  stuck = [r for r in range(p) if position[r] < len(schedules[r])]
  if stuck:
    raise ScheduleError(f'deadlock: ranks {stuck} wait forever; ' + '; '.join(
        f'rank {r} at action #{position[r]} waits on {unmatched(r)}' for r in stuck))
  for rank in range(p):
    missing = [(k, i, c) for k in 'FB' for i in range(m) for c in range(v) if (k, i, c * p + rank) not in done]
    if missing or inbox[rank]:
      raise ScheduleError(f'rank {rank} never runs {missing[:3]}, never uses {sorted(inbox[rank])[:3]}')
  makespan = max(clock)
  return Simulation(makespan, tuple(busy), 1 - sum(busy) / (p * makespan),
                    makespan / max(busy) - 1, tuple(peak))


class BubbleRow(typing.NamedTuple):
  p: int
  m: int
  v: int
  simulated: float        # bubble / ideal time, unit forward and backward costs
  formula: float          # (p-1) / (v*m), Narayanan et al. 2021


def bubble_table(ps=(2, 4, 8), ms=(4, 8, 16), vs=(1, 2)):
  """Rows of simulated vs textbook bubble for make_schedule (docs/parallelism.md's table)."""
  return [BubbleRow(p, m, v, simulate(p, m, v, 1.0, 1.0).bubble_ratio, (p - 1) / (v * m))
          for p in ps for m in ms for v in vs]

