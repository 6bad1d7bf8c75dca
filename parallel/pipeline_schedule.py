"""Pipeline schedules as data: the ordered actions each pipeline rank runs in one step.

With p ranks and v chunks per rank there are p*v virtual stages; rank r holds chunks
c = 0..v-1, which are virtual stages c*p + r (Megatron's interleaved layout). Virtual stage
0 embeds the tokens, virtual stage p*v-1 ends in the loss. A schedule is a tuple of:
  Compute('F' | 'B', microbatch, chunk)   forward / backward of a microbatch on a chunk
  Comm(ops)                               P2P ops issued as one batch_isend_irecv
  P2P('send' | 'recv', 'act' | 'grad', microbatch, chunk, peer)
'act' is a forward output going to the next virtual stage, 'grad' the gradient of a
chunk's input going to the previous one. `chunk` is the local chunk that produced (send) or
will consume (recv) the tensor; `peer` is a rank of the pipeline group.

Executor contract: run the actions in order with two dicts keyed (tensor, microbatch, chunk).
  F(i, c): the input is microbatch i's tokens on virtual stage 0, else inbox.pop(('act', i, c))
      made to require grad. Run chunk c; on the last virtual stage its output is microbatch
      i's loss (scaled for accumulation). Keep (input, output) for B; unless last, also
      outbox[('act', i, c)] = output.detach().
  B(i, c): backward from the kept output: from the loss itself on the last virtual stage,
      else with gradient inbox.pop(('grad', i, c)). Unless virtual stage 0, put the input's
      .grad in outbox[('grad', i, c)]. Drop the kept pair.
  Comm(ops): in list order, a send is P2POp(isend, outbox.pop(key), peer), a recv is
      P2POp(irecv, a new buffer of the static shape, peer) with inbox[key] = that buffer;
      dist.batch_isend_irecv(all of them), then wait on every request.
Both ends list each transfer in the same relative order, so per-pair FIFO matching (NCCL;
gloo with the default tag) pairs every send with its recv. With NCCL, barrier once on the
pipeline group first: a group's first batch_isend_irecv must involve all its ranks.

Why it cannot deadlock. A policy (GPipe, 1F1B, interleaved 1F1B) gives each rank's computes
in order, cut into steps. `_build` lets each step take one time unit, starts it as soon as
its inputs from other ranks exist, and posts every transfer on both ends at the time T its
producer's step ends; a rank's ops at one T form one Comm. A Comm at T waits only for Comms
at the same T on other ranks, so by induction on T all complete, whatever the real costs.
Megatron's steps (one compute in 1F1B, an F+B pair in steady interleaved steps) also keep
ranks in step when a backward costs more than a forward: where the textbook bubble formula
holds, the simulated bubble equals it for backward/forward cost ratios 1 to 3 (tests).

estimates/schedule_sim.py runs all ranks' lists under blocking batched semantics and checks all
of the above without knowing how the lists were made.
"""
import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Compute:
  kind: str         # 'F' forward, 'B' backward
  microbatch: int
  chunk: int        # local chunk; virtual stage chunk * p + rank


@dataclasses.dataclass(frozen=True)
class P2P:
  kind: str         # 'send' or 'recv'
  tensor: str       # 'act' (to the next virtual stage) or 'grad' (to the previous one)
  microbatch: int
  chunk: int        # the local chunk that produced (send) or will consume (recv) it
  peer: int         # rank in the pipeline group


@dataclasses.dataclass(frozen=True)
class Comm:
  ops: tuple        # of P2P, one batch_isend_irecv


class ScheduleError(RuntimeError):
  """A schedule that would hang, mismatch its comms or break a data dependency."""


# --- policies: each rank's computes, in order, cut into steps ------------------------------


def _warmup_then_alternate(forwards, backwards, warmup, paired):
  """`warmup` forwards, then forward + backward per step, then the remaining backwards;
  `paired` makes each steady F+B one step (one exchange after both), else one per compute."""
  steady = len(forwards) - warmup
  pairs = list(zip(forwards[warmup:], backwards[:steady]))
  middle = pairs if paired else [(a,) for pair in pairs for a in pair]
  return [(f,) for f in forwards[:warmup]] + middle + [(b,) for b in backwards[steady:]]


def _single_chunk_steps(m, warmup):
  forwards = [Compute('F', i, 0) for i in range(m)]
  backwards = [Compute('B', i, 0) for i in range(m)]
  return _warmup_then_alternate(forwards, backwards, warmup, paired=False)


def _gpipe_steps(p, m, v, rank):
  return _single_chunk_steps(m, warmup=m)


def _one_f_one_b_steps(p, m, v, rank):
  return _single_chunk_steps(m, warmup=min(p - rank - 1, m))


def _interleaved_steps(p, m, v, rank):
  # Megatron's table: microbatches in groups of p; a group runs forward through chunks
  # 0, 1, .., v-1 and backward through v-1, .., 0. The warm-up covers the first backward's
  # wait: (v-1)*p forwards to reach the last chunk and 2 per later rank for the round trip.
  # Those 2 (1F1B has 1) leave room for one exchange per F+B step, Megatron's
  # send_forward_backward_recv_forward_backward, which keeps ranks in step when B != F.
  padded_m = -(-m // p) * p
  table = [(i, c) for first in range(0, padded_m, p) for c in range(v)
           for i in range(first, first + p)]
  forwards = [Compute('F', i, c) for i, c in table]
  backwards = [Compute('B', i, v - 1 - c) for i, c in table]
  warmup = min(2 * (p - rank - 1) + (v - 1) * p, padded_m * v)
  steps = _warmup_then_alternate(forwards, backwards, warmup, paired=True)
  # Megatron's original needs p | m. For other m, schedule ceil(m/p)*p microbatches and drop those
  # that do not exist: a subsequence of an acyclic order stays acyclic (each kept
  # constraint was implied before) and holds no more activations.
  steps = [tuple(a for a in step if a.microbatch < m) for step in steps]
  return [step for step in steps if step]


# --- from steps to action lists -----------------------------------------------------------


def _dependencies(kind, i, vs, num_stages):
  """(kind, microbatch, virtual stage) computes that must finish before this one starts."""
  if kind == 'F':
    return [('F', i, vs - 1)] if vs > 0 else []
  return [('F', i, vs)] + ([('B', i, vs + 1)] if vs < num_stages - 1 else [])


def _step_end_times(p, v, steps):
  """End time of every compute when each step takes one time unit and starts as soon as
  the steps that produce its inputs on other ranks have ended (inputs from its own rank may
  come from earlier in the same step)."""
  end, clock, position = {}, [0] * p, [0] * p
  progressed = True
  while progressed:
    progressed = False
    for rank in range(p):
      while position[rank] < len(steps[rank]):
        keys = [(a.kind, a.microbatch, a.chunk * p + rank) for a in steps[rank][position[rank]]]
        deps = {d for k in keys for d in _dependencies(*k, p * v)} - set(keys)
        if any(d not in end for d in deps):
          break
        clock[rank] = max([clock[rank]] + [end[d] for d in deps]) + 1
        end.update((k, clock[rank]) for k in keys)
        position[rank] += 1
        progressed = True
  stuck = [r for r in range(p) if position[r] < len(steps[r])]
  if stuck:
    raise ScheduleError(f'policy orders are cyclic; ranks {stuck} wait at '
                        f'{[steps[r][position[r]] for r in stuck]}')
  return end


@functools.lru_cache(maxsize=64)
def _build(policy, p, m, v):
  """All ranks' action lists for `policy(p, m, v, rank)` -> that rank's steps."""
  steps = [policy(p, m, v, rank) for rank in range(p)]
  end = _step_end_times(p, v, steps)
  timed = [[] for _ in range(p)]          # (time, 0 = comm | 1 = compute, order key, item)
  for rank in range(p):
    for step in steps[rank]:
      for k, a in enumerate(step):
        timed[rank].append((end[(a.kind, a.microbatch, a.chunk * p + rank)] - 1, 1, k, a))
  for i in range(m):
    for vs in range(p * v - 1):
      for tensor, src, dst in (('act', vs, vs + 1), ('grad', vs + 1, vs)):
        # Both ends post the transfer at the end of the producer's step; `key`, the same on
        # both ends, fixes its place among the ops of that time.
        t, key = end[('F' if tensor == 'act' else 'B', i, src)], (tensor, i, src)
        timed[src % p].append((t, 0, key, P2P('send', tensor, i, src // p, dst % p)))
        timed[dst % p].append((t, 0, key, P2P('recv', tensor, i, dst // p, src % p)))
  schedules = []
  for items in timed:
    actions, comm_time = [], None
    for t, is_compute, _, item in sorted(items, key=lambda x: x[:3]):
      if is_compute:
        actions.append(item)
      elif actions and isinstance(actions[-1], Comm) and comm_time == t:
        actions[-1] = Comm(actions[-1].ops + (item,))
      else:
        actions.append(Comm((item,)))
        comm_time = t
    schedules.append(tuple(actions))
  return tuple(schedules)


# --- public schedules ---------------------------------------------------------------------


def _check_sizes(p, m, v, rank):
  if p < 1 or m < 1 or v < 1 or not 0 <= rank < p:
    raise ValueError(f'need p >= 1, m >= 1, v >= 1 and 0 <= rank < p; got p={p} m={m} v={v} '
                     f'rank={rank}')


def gpipe(p, m, rank):
  """All forwards, then all backwards: holds all m microbatches' activations."""
  _check_sizes(p, m, 1, rank)
  return _build(_gpipe_steps, p, m, 1)[rank]


def one_f_one_b(p, m, rank):
  """PipeDream-flush 1F1B: min(p-rank-1, m) warm-up forwards, then F/B pairs, then cool-down."""
  _check_sizes(p, m, 1, rank)
  return _build(_one_f_one_b_steps, p, m, 1)[rank]


def interleaved_one_f_one_b(p, m, v, rank):
  """Megatron's interleaved 1F1B with v chunks per rank; any m >= 1, p >= 2."""
  _check_sizes(p, m, v, rank)
  if p < 2:
    raise ValueError(f'interleaving needs p >= 2 ranks (got p={p}, v={v}): on one rank the '
                     'chunks would just run back to back; use v=1')
  return _build(_interleaved_steps, p, m, v)[rank]


def make_schedule(p, m, v, rank):
  """The schedule Megatron would run: 1F1B for v == 1, interleaved 1F1B otherwise."""
  if v == 1:
    return one_f_one_b(p, m, rank)
  return interleaved_one_f_one_b(p, m, v, rank)
