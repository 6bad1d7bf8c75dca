"""Pipeline schedules as data: complete, ordered, matched (checked by the simulator), and each
policy's order of computes and transfers."""
import collections

import pytest

from estimates import schedule_sim
from parallel import pipeline_schedule as ps
from parallel.pipeline_schedule import Comm, Compute, P2P, ScheduleError


def _grid():
  """(p, m, v) with m below, at and around multiples of p, and the largest m."""
  for p in range(1, 9):
    ms = sorted({m for m in (1, 2, p - 1, p, p + 1, 2 * p, 2 * p + 1, 3 * p, 32) if m >= 1})
    for v in ([1] if p == 1 else [1, 2, 3, 4]):
      for m in ms:
        yield p, m, v


GRID = list(_grid())


def _all_ranks(p, m, v):
  return [ps.make_schedule(p, m, v, rank) for rank in range(p)]


def short(schedule):
  """Compact text of a schedule: F0.1 is forward of microbatch 0 on chunk 1."""
  return [f'{a.kind}{a.microbatch}.{a.chunk}' if isinstance(a, Compute) else
          '[' + ' '.join(f'{o.kind} {o.tensor}{o.microbatch}.{o.chunk}@{o.peer}' for o in a.ops) + ']'
          for a in schedule]


def check_structure(p, m, v, schedules):
  """Checks the action lists alone, without the simulator."""
  num_stages, sends, recvs = p * v, collections.Counter(), collections.Counter()
  for rank, schedule in enumerate(schedules):
    computes = [a for a in schedule if isinstance(a, Compute)]
    assert collections.Counter(computes) == collections.Counter(
        Compute(k, i, c) for k in 'FB' for i in range(m) for c in range(v)), rank
    have = set()                         # what this rank holds: computed or received
    for a in schedule:
      if isinstance(a, Compute):
        vs = a.chunk * p + rank
        if a.kind == 'F':
          assert vs == 0 or ('recv', 'act', a.microbatch, a.chunk) in have, (rank, a)
        else:
          assert ('F', a.microbatch, a.chunk) in have, (rank, a)
          assert vs == num_stages - 1 or ('recv', 'grad', a.microbatch, a.chunk) in have, (rank, a)
        have.add((a.kind, a.microbatch, a.chunk))
        continue
      assert isinstance(a, Comm) and a.ops, (rank, a)
      for op in a.ops:
        vs = op.chunk * p + rank
        towards = 1 if op.tensor == 'act' else -1
        if op.kind == 'send':
          assert ('F' if op.tensor == 'act' else 'B', op.microbatch, op.chunk) in have, (rank, op)
          transfer = (op.tensor, op.microbatch, vs, vs + towards)
          sends[transfer] += 1
        else:
          have.add(('recv', op.tensor, op.microbatch, op.chunk))
          transfer = (op.tensor, op.microbatch, vs - towards, vs)
          recvs[transfer] += 1
        assert 0 <= transfer[3] < num_stages and op.peer == transfer[3 if op.kind == 'send' else 2] % p
  # Every boundary between virtual stages carries each microbatch once each way.
  boundaries = [(i, s) for i in range(m) for s in range(num_stages - 1)]
  expected = collections.Counter([('act', i, s, s + 1) for i, s in boundaries]
                                 + [('grad', i, s + 1, s) for i, s in boundaries])
  assert sends == recvs == expected


@pytest.mark.parametrize('p,m,v', GRID)
def test_schedules_are_complete_ordered_matched_and_finish(p, m, v):
  schedules = _all_ranks(p, m, v)
  check_structure(p, m, v, schedules)
  for fwd_cost, bwd_cost, comm_cost in ((1, 1, 0), (1, 2, 0), (1, 3, 0.25)):
    schedule_sim.simulate(p, m, v, fwd_cost, bwd_cost, comm_cost)      # raises on deadlock or mismatch


def test_one_stage_is_forward_backward_pairs_without_comms():
  assert short(ps.make_schedule(1, 3, 1, 0)) == ['F0.0', 'B0.0', 'F1.0', 'B1.0', 'F2.0', 'B2.0']


def test_one_f_one_b_compute_order_is_warmup_steady_cooldown():
  p, m = 4, 6
  for rank in range(p):
    order = [a for a in ps.one_f_one_b(p, m, rank) if isinstance(a, Compute)]
    warmup = p - rank - 1
    expected = [('F', i) for i in range(warmup)]
    for i in range(m - warmup):
      expected += [('F', i + warmup), ('B', i)]
    expected += [('B', i) for i in range(m - warmup, m)]
    assert [(a.kind, a.microbatch) for a in order] == expected


def test_one_f_one_b_pairs_send_forward_with_recv_backward():
  # Megatron's send_forward_recv_backward: in the steady state a stage hands over its new
  # activation and takes the next gradient in one batch.
  steady = ps.one_f_one_b(2, 3, 0)
  assert Comm((P2P('send', 'act', 2, 0, 1), P2P('recv', 'grad', 1, 0, 1))) in steady
  assert short(ps.one_f_one_b(2, 2, 1)) == [
      '[recv act0.0@0]', 'F0.0', '[recv act1.0@0]', 'B0.0', '[send grad0.0@0]', 'F1.0', 'B1.0',
      '[send grad1.0@0]']


def test_interleaved_layout_and_peers():
  p, m, v = 4, 8, 2
  for rank, schedule in enumerate(_all_ranks(p, m, v)):
    ops = [op for a in schedule if isinstance(a, Comm) for op in a.ops]
    assert {op.peer for op in ops} <= {(rank - 1) % p, (rank + 1) % p}
    # Virtual stage 0 (rank 0, chunk 0) receives no activation; the last sends none.
    assert not any(rank == 0 and op.chunk == 0 and op.tensor == 'act' and op.kind == 'recv' for op in ops)
    assert not any(rank == p - 1 and op.chunk == v - 1 and op.tensor == 'act' and op.kind == 'send'
                   for op in ops)
  # Rank 3's chunk 0 (virtual stage 3) feeds rank 0's chunk 1 (virtual stage 4).
  assert any(P2P('send', 'act', 0, 0, 0) in a.ops for a in _all_ranks(p, m, v)[3] if isinstance(a, Comm))
