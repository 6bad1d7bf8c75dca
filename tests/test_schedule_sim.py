"""estimates/schedule_sim.py: bubble and memory of the schedules vs. the formulas, and the
simulator catching deadlocks, mismatched transfers, early computes and wrong peers."""
import pytest

from estimates import schedule_sim
from parallel import pipeline_schedule as ps
from parallel.pipeline_schedule import Comm, P2P, ScheduleError
from tests.test_pipeline_schedule import GRID, check_structure, short


@pytest.mark.parametrize('p', range(1, 9))
@pytest.mark.parametrize('m', [1, 2, 3, 5, 8, 13, 16, 32])
def test_one_f_one_b_bubble_and_memory_match_the_formulas(p, m):
  for bwd_cost in (1.0, 2.0, 3.0):
    sim = schedule_sim.simulate(p, m, 1, 1.0, bwd_cost)
    assert sim.bubble_ratio == pytest.approx((p - 1) / m, abs=1e-9)
    assert sim.idle_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert sim.busy == (m * (1.0 + bwd_cost),) * p
  # Stage r holds at most p - r microbatches' activations (stage 0: min(p, m)).
  assert sim.peak_in_flight == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize('p,m,v', [g for g in GRID if g[2] > 1])
def test_interleaved_bubble_and_memory(p, m, v):
  # Each rank runs 2*(p-r-1) + (v-1)*p forwards before its first backward, so it holds at
  # most that + 1 chunk activations: on rank 0, v*p + p - 1, i.e. p + (p-1)/v full-stage
  # microbatches against 1F1B's p.
  bound = tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))
  for bwd_cost in (1.0, 2.0, 3.0):
    sim = schedule_sim.simulate(p, m, v, 1.0, bwd_cost)
    if m % p == 0:
      assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-9)
      assert sim.peak_in_flight == bound
    else:                   # between the interleaved formula and plain 1F1B
      assert (p - 1) / (v * m) - 1e-9 <= sim.bubble_ratio <= (p - 1) / m + 1e-9
      assert all(peak <= b for peak, b in zip(sim.peak_in_flight, bound))


def test_gpipe_has_the_same_bubble_but_holds_every_microbatch():
  p, m = 4, 8
  sim = schedule_sim.simulate(p, m, 1, 1.0, 1.0, schedules=[ps.gpipe(p, m, r) for r in range(p)])
  assert sim.bubble_ratio == pytest.approx((p - 1) / m, abs=1e-9)
  assert sim.peak_in_flight == (m,) * p
  check_structure(p, m, 1, [ps.gpipe(p, m, r) for r in range(p)])


def _one_f_one_b_2x3():
  return [list(ps.one_f_one_b(2, 3, rank)) for rank in range(2)]


def test_swapped_comm_groups_deadlock_and_the_error_names_the_ranks():
  schedules = _one_f_one_b_2x3()
  assert short(schedules[0])[3:5] == ['[send act1.0@1]', '[recv grad0.0@1]']
  # Rank 0 now waits for microbatch 0's gradient before handing over microbatch 1, which
  # rank 1 needs first.
  schedules[0][3], schedules[0][4] = schedules[0][4], schedules[0][3]
  with pytest.raises(ScheduleError, match=r'deadlock: ranks \[0, 1\].*rank 0 at action #3 waits on '
                     r"\[P2P\(kind='recv', tensor='grad', microbatch=0"):
    schedule_sim.simulate(2, 3, 1, schedules=schedules)


def test_swapped_receives_are_a_mismatch():
  schedules = _one_f_one_b_2x3()
  schedules[1][0], schedules[1][2] = schedules[1][2], schedules[1][0]
  with pytest.raises(ScheduleError, match=r'mismatch: message #0 from rank 0 to rank 1'):
    schedule_sim.simulate(2, 3, 1, schedules=schedules)


def test_compute_before_its_input_arrives_is_reported():
  schedules = _one_f_one_b_2x3()
  schedules[1][0], schedules[1][1] = schedules[1][1], schedules[1][0]
  with pytest.raises(ScheduleError, match='rank 1: .* runs before it received its input'):
    schedule_sim.simulate(2, 3, 1, schedules=schedules)


def test_wrong_peer_is_reported():
  schedules = _one_f_one_b_2x3()
  schedules[0][1] = Comm((P2P('send', 'act', 0, 0, 0),))
  with pytest.raises(ScheduleError, match='no such peer stage'):
    schedule_sim.simulate(2, 3, 1, schedules=schedules)


def test_invalid_sizes_are_rejected():
  with pytest.raises(ValueError, match='interleaving needs p >= 2'):
    ps.make_schedule(1, 4, 2, 0)
  with pytest.raises(ValueError, match='m >= 1'):
    ps.make_schedule(4, 0, 1, 0)
  with pytest.raises(ValueError, match='rank < p'):
    ps.make_schedule(4, 4, 2, 4)


def test_bubble_table():
  rows = schedule_sim.bubble_table()
  print('\n  p   m   v   simulated   (p-1)/(v*m)')
  for row in rows:
    print(f'{row.p:3d} {row.m:3d} {row.v:3d}   {row.simulated:9.4f}   {row.formula:11.4f}')
  assert len(rows) == 18
  for row in rows:
    if row.m % row.p == 0:
      assert row.simulated == pytest.approx(row.formula, abs=1e-9)
