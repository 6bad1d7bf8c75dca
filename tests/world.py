"""Run a function on N spawned processes that see torchrun's environment (gloo, CPU).

    results = world.run(fn, 4, arg1, arg2)     # fn(*args) on ranks 0..3, returns [r0, r1, r2, r3]
    world.run(world.in_turn, 2, [(f, args), (g, args)])   # several runs in one world

Spawn, not fork (tensorstore aborts in a forked child). Each rank gets one thread (the ranks
share the machine's cores). `fn` must be importable (module level). A rank that raises
fails the call with its traceback; a world that does not finish within `timeout` is killed
and the error names the ranks still running. Collective timeouts inside fn come from
distributed_strategy.collective_timeout_s, which the tests set low.
"""
import os
import pickle
import queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
  os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),
                    OMP_NUM_THREADS='1')
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)
  try:
    # pickled to bytes here: a tensor put on the queue as it is travels as a file descriptor that
    # this process serves, and a rank that has exited by the time a busy parent reads it fails the
    # read (FileNotFoundError from multiprocessing's resource sharer)
    results.put((rank, 'ok', pickle.dumps(fn(*args))))
  except BaseException:  # pylint: disable=broad-except
    results.put((rank, 'error', traceback.format_exc()))
  finally:
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    if dist.is_initialized():
      dist.destroy_process_group()


def in_turn(calls):
  """[fn(*args) for fn, args in calls] on this rank: several runs in one world, e.g.
  world.run(world.in_turn, 2, [(f, (a,)), (g, (b,))]) (spawning and initializing a world
  costs seconds; each run builds its own mesh groups)."""
  return [fn(*args) for fn, args in calls]


def run(fn, world_size, *args, timeout=240):
  ctx = mp.get_context('spawn')
  results = ctx.Queue()
  port = free_port()
  procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
           for r in range(world_size)]
  for p in procs:
    p.start()
  out, errors = {}, []
  try:
    while len(out) + len(errors) < world_size:
      try:
        rank, status, value = results.get(timeout=timeout)
      except queue.Empty:
        missing = sorted(set(range(world_size)) - set(out) - {e[0] for e in errors})
        raise TimeoutError(f'ranks {missing} of {world_size} did not finish within {timeout}s '
                           '(a hang: look for a collective some ranks never reached)') from None
      if status == 'ok':
        out[rank] = pickle.loads(value)
      else:
        errors.append((rank, value))
        break                      # the others may now block on the failed rank forever
  finally:
    for p in procs:
      p.join(timeout=5 if not errors else 0.1)
      if p.is_alive():
        p.kill()
  if errors:
    rank, tb = errors[0]
    raise RuntimeError(f'rank {rank} of {world_size} failed:\n{tb}')
  return [out[r] for r in range(world_size)]
