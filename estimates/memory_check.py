"""Whether a run fits: what a rank may use (device memory, or the host's RAM over its local
ranks; for a dry run, the device of the cluster trainer.plan_cluster names), the layouts of a
world size whose estimate (estimates/memory.py) fits it, and the refusal before allocating when
this one does not (trainer.memory_check)."""
import copy
import os

import torch

from estimates import clusters, host_heap, memory
from parallel import device as devices
from model import param_table


def available_bytes(device, local_ranks=1):
  """(bytes one rank may use, where the figure comes from): device memory on CUDA, else the
  host's available RAM shared by the ranks of this host. None when unknown."""
  if device.type == 'cuda':
    return torch.cuda.mem_get_info(device)[1], f'{torch.cuda.get_device_name(device)} memory'
  available = host_available_bytes()
  if available is None:
    return None, 'unknown'
  return available // local_ranks, f'available host RAM / {local_ranks} local rank(s)'


def target_bytes(config):
  """(bytes one device has, what it is) on the cluster trainer.plan_cluster names, or None when it
  names none (auto, none): what a dry run judges a run planned for that cluster against."""
  name = config.trainer.get('plan_cluster', 'auto')
  if name in ('auto', 'none'):
    return None
  cluster = clusters.get(name)
  return cluster.memory_bytes, f'a {cluster.name} device'


def host_available_bytes():
  """MemAvailable of /proc/meminfo (Linux), or less where this process's cgroup sets a memory
  limit (a container's, or systemd-run -p MemoryMax=): its room left. None where neither tells."""
  try:
    with open('/proc/meminfo') as f:
      info = dict(line.split(':', 1) for line in f)
    available = int(info['MemAvailable'].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    available = None
  room = [b for b in (available, cgroup_room_bytes()) if b is not None]
  return min(room) if room else None


def cgroup_room_bytes(proc_cgroup='/proc/self/cgroup', root='/sys/fs/cgroup'):
  """The memory this process's cgroup may still take (its limit less its usage), or None where
  no limit is set or it can't be read. cgroup v2 (`0::/path`: memory.max, memory.current) or
  v1 (`N:memory:/path`: memory.limit_in_bytes, memory.usage_in_bytes)."""
  try:
    with open(proc_cgroup) as f:
      lines = [line.rstrip('\n').split(':', 2) for line in f]
  except OSError:
    return None
  for _, controllers, path in lines:
    if controllers == '':
      mount, files = root, ('memory.max', 'memory.current')
    elif 'memory' in controllers.split(','):
      mount, files = os.path.join(root, 'memory'), ('memory.limit_in_bytes', 'memory.usage_in_bytes')
    else:
      continue
    # the cgroup's own folder, or the mount's root where a container shows its cgroup as the root
    for base in (os.path.join(mount, path.lstrip('/')), mount):
      try:
        with open(os.path.join(base, files[0])) as f:
          limit = f.read().strip()
        with open(os.path.join(base, files[1])) as f:
          usage = int(f.read())
      except (OSError, ValueError):
        continue
      if limit != 'max' and int(limit) < 1 << 60:       # v1 says "no limit" with a huge number
        return max(0, int(limit) - usage)
      break
  return None


# memory is short where the untrimmed estimate passes this share of what a rank has
SHORT = 0.9


def heap_trim(config, mesh, est, before_bytes):
  """Whether this rank's kept heap (CPU, keep_freed_host_memory) hands its free pages back near the
  estimate (trim_host_heap: True; auto: only where memory is short, the untrimmed estimate past
  SHORT of what the rank has), arming the trim where it does. Returns (the estimate that holds
  for the choice, a line for the log; None where no heap is kept)."""
  setting = devices.trim_setting(config)
  if not devices.keeps_host_heap() or before_bytes is None:
    return est, None
  if setting == 'auto':
    budget, source = available_bytes(mesh.device, int(os.environ.get('LOCAL_WORLD_SIZE', '1')))
    if budget is None or est['total'] <= SHORT * budget:
      return est, (f'never trimmed (trim_host_heap=auto: the estimate, {memory.human_bytes(est["total"])}, is '
                   + (f'{est["total"] / budget:.0%} of {memory.human_bytes(budget)}, {source})' if budget else
                      'all the check has: the host\'s memory is unknown)'))
    reason = f'memory is short: the untrimmed estimate, {memory.human_bytes(est["total"])}, passes ' \
             f'{SHORT:.0%} of {memory.human_bytes(budget)}, {source}'
  elif setting is True:
    reason = 'trim_host_heap=True'
  else:
    return est, 'never trimmed (trim_host_heap=False)'
  est = memory.with_heap_trimmed(config, est)
  limit = host_heap.host_heap_limit(est, before_bytes)
  devices.trim_heap_past(limit)
  return est, f'free pages released past {memory.human_bytes(limit)} resident ({reason})'


def fitting_layouts(config, world_size, budget, check) -> list:
  """(description, bytes per rank) of every valid tp x pp (x ZeRO-1) layout of `world_size`
  processes (at the configured context_parallel_size) whose estimate fits `budget`, smallest
  first. `check(config, world_size)` lists a config's problems (configs/validate.py)."""
  out, cp = [], config.distributed_strategy.get('context_parallel_size', 1)   # kept as configured
  replicas = world_size // cp if world_size % cp == 0 else 0
  for tp in (n for n in range(1, replicas + 1) if replicas % n == 0):
    for pp in (n for n in range(1, replicas // tp + 1) if (replicas // tp) % n == 0):
      dp = replicas // (tp * pp)
      for zero1 in ((False, True) if dp * cp > 1 else (False,)):
        c = copy.deepcopy(config)
        d = c.distributed_strategy
        d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.zero1 = tp, pp, zero1
        d.virtual_pipeline_model_parallel_size, d.pipeline_cuts = 1, ()
        d.sequence_parallel = d.sequence_parallel and tp > 1
        kv = param_table.kv_heads(c.model)
        d.kv_replicator = tp // kv if tp > kv and tp % kv == 0 else 1
        if check(c, world_size):
          continue
        est = memory.estimate(c, None, dp)
        # where memory is short, trim_host_heap's auto trims the kept heap near the estimate
        need = (memory.with_heap_trimmed(c, est) if devices.trim_setting(c) == 'auto' else est)['total']
        if need <= budget:
          out.append((f'tp={tp} pp={pp}' + (f' cp={cp}' if cp > 1 else '') + (' zero1' if zero1 else ''), need))
  return sorted(out, key=lambda item: item[1])


def check_fits(config, mesh, est, check, target=None):
  """Refuse before allocating when the estimate `est` per rank exceeds what the rank has
  (trainer.memory_check), naming both figures and the layouts that would fit. `target`:
  (bytes, what) to judge against instead of this machine (target_bytes)."""
  local_ranks = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
  budget, source = target or available_bytes(mesh.device, local_ranks)
  if not config.trainer.memory_check or budget is None or est['total'] <= budget:
    return
  fits = fitting_layouts(config, mesh.world_size, budget, check)
  preset = f'configs/{config.name}.py' if os.path.isfile(f'configs/{config.name}.py') else 'configs/<model>.py'
  hint = (f'layouts of {mesh.world_size} process(es) that fit: '
          + ', '.join(f'{name} ({memory.human_bytes(need)})' for name, need in fits[:4])
          if fits else f'no layout of {mesh.world_size} process(es) fits; use more devices or a '
          f'smaller model, e.g. the CPU-sized preset --config={preset}:smoke')
  raise MemoryError(
      f'this run needs an estimated {memory.human_bytes(est["total"])} per rank but a rank has '
      f'{memory.human_bytes(budget)} ({source}); {hint}. Set --config.trainer.memory_check=False '
      'to try anyway.')


def measured_peak_bytes(device):
  """This process's peak so far: resident set (CPU; Linux reports KiB), or the device's peak
  allocation (CUDA); None elsewhere."""
  if device.type == 'cuda':
    return torch.cuda.max_memory_allocated(device)
  if device.type == 'cpu':
    import resource  # pylint: disable=import-outside-toplevel
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return None


def peak_report(mesh, estimate_bytes, before_bytes) -> str:
  """Every rank's measured peak beside its start-up estimate, one line (collective: every rank
  calls it; rank 0's string is the whole world's). The estimate is of the run's own memory: on
  the CPU, the peak RSS less the process's before the run (`before_bytes`: Python, torch and
  the libraries, ~300-450 MiB) is set against it."""
  peak = measured_peak_bytes(mesh.device)
  if peak is None:
    return ''
  mine = torch.tensor([float(peak - (before_bytes or 0)), float(estimate_bytes), float(peak)], dtype=torch.float64,
                      device=mesh.device)      # (NCCL gathers device tensors)
  if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
    every = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every, mine)
  else:
    every = [mine]
  what = 'peak RSS over the process before the run' if mesh.device.type == 'cpu' else 'peak allocated'
  mib = lambda n: f'{n / 2**20:,.0f} MiB'     # pylint: disable=unnecessary-lambda-assignment
  parts = [f'rank {r}: {mib(p)} ({p / e - 1:+.1%} of {mib(e)}; {mib(a)} in all)'
           for r, (p, e, a) in enumerate(t.tolist() for t in every)]
  return f'{what}, against the start-up estimate: ' + ', '.join(parts)
