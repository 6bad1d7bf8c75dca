"""The device layer: which device, which collective backend, the peak FLOP/s for MFU, and how
the host's C library hands out memory (keep_freed_host_memory).

cpu (gloo), cuda (nccl) and xla (torch-xla: Trainium, TPU; parallel/xla.py) share one path;
torch_xla is imported only when the device is an XLA one.
"""
import ctypes
import os
import time

import torch
import torch.distributed as dist

import host_values
from parallel import xla

# Dense bf16 datasheet peaks (never sparse), matched in order against
# torch.cuda.get_device_name() ('NVIDIA H100 80GB HBM3' is the SXM part): the PCIe and NVL
# H100s first, as their names hold 'H100' too.
CUDA_PEAK_BF16 = (('H100 PCIe', 756e12), ('H100 NVL', 835e12), ('H200', 989e12), ('H100', 989e12),
                  ('A100', 312e12), ('L40S', 362e12), ('A10G', 125e12), ('L4', 121e12), ('V100', 125e12))


def datasheet_peak(name: str):
  """The dense bf16 peak FLOP/s of the CUDA device called `name`, or None if not listed."""
  return next((flops for key, flops in CUDA_PEAK_BF16 if key in name), None)


def kind(name: str) -> str:
  """The device kind config.device names: `auto` is cuda where it is available, else the
  accelerator a PyTorch plug-in provides (torch.accelerator: e.g. TorchNeuron's `neuron`), else cpu."""
  if name == 'auto':
    if torch.cuda.is_available():
      return 'cuda'
    accelerator = getattr(torch, 'accelerator', None)     # torch >= 2.6
    current = accelerator.current_accelerator() if accelerator is not None and accelerator.is_available() else None
    return current.type if current is not None else 'cpu'
  return name


def check_name(name: str) -> list:
  """Problems with config.device: auto, cpu, cuda, xla, or a device type this PyTorch knows
  (one a plug-in registers, such as TorchNeuron's `neuron`)."""
  if name in ('auto', 'cpu', 'cuda', 'xla'):
    return []
  try:
    torch.device(name)
  except (RuntimeError, ValueError):
    return [f'device={name!r}: not a device type this PyTorch knows; use auto, cpu, cuda or xla, or install '
            f'the PyTorch plug-in that provides {name!r} (e.g. TorchNeuron for `neuron`)']
  return []


def resolve(name: str, local_rank: int = 0) -> torch.device:
  name = kind(name)
  if name == 'cuda':
    if not torch.cuda.is_available():
      raise RuntimeError('device=cuda but torch.cuda.is_available() is False; use --config.device=cpu')
    torch.cuda.set_device(local_rank)
    return torch.device('cuda', local_rank)
  if name == 'xla':
    try:
      import torch_xla  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
      raise RuntimeError('device=xla needs torch-xla (its own environment: make test-xla, see docs/xla.md)') from e
    return xla.device()
  if name == 'cpu':
    return torch.device('cpu')
  device = torch.device(name, local_rank)    # a plug-in's device (check_name): its accelerator API
  torch.accelerator.set_device_index(device)
  return device


def backend(device: torch.device, name: str = 'auto') -> str:
  """The process-group backend: config.backend's `name`, or with `auto` the device's own (gloo
  on the CPU, nccl on CUDA, xla on XLA, the one a plug-in registers for its device type)."""
  if name != 'auto':
    return name
  if device.type == 'xla':
    return 'xla'
  return dist.Backend.default_device_backend_map.get(device.type, 'gloo')


def host_backend(backend_name: str) -> str:
  """The backend of the host group (agreements on CPU tensors): the run's own where it takes
  CPU tensors (gloo, fake), else gloo."""
  return backend_name if 'cpu' in dist.Backend.backend_capability.get(backend_name, ()) else 'gloo'


def collective_backend(config) -> str:
  """The backend a run of `config` would use, without starting anything: what the estimates
  assume of its collectives (gloo's point-to-point reduce-scatter, or a native one)."""
  return backend(torch.device(kind(config.device)), config.get('backend', 'auto'))


def check_backend(name: str) -> list:
  """Problems with config.backend: auto, or a backend torch.distributed has (gloo, nccl, ...;
  xla with torch-xla; one a plug-in registers); not `fake`, which only a trace sets."""
  known = ['auto', 'xla'] + [b for b in dist.Backend.backend_list if b not in ('undefined', 'fake')]
  if name == 'fake':       # its collectives do nothing: a run on it would train on wrong numbers
    return ["backend='fake' is the traced dry run's (its collectives do nothing); use --dry_run=trace, which "
            'sets it itself, and auto or a real backend to train']
  if name in known:
    return []
  return [f'backend={name!r}: not a process-group backend this PyTorch has ({", ".join(known)}); '
          'use auto (the device\'s own) or install the plug-in that registers it']


def synchronize(device: torch.device):
  """Wait for queued device work (timing only; never in the hot path except logging steps)."""
  if device.type == 'cuda':
    torch.cuda.synchronize(device)
  elif device.type == 'xla':
    xla.step_boundary()
    xla.wait()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# blocks up to the first come from the heap; the second where a glibc refuses that (its old cap)
_KEPT_MMAP_THRESHOLDS = (1 << 30, 32 << 20)
# the environment's say over glibc's malloc, which keep_freed_host_memory then leaves alone
MALLOC_ENV = ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_', 'MALLOC_MMAP_MAX_', 'MALLOC_TOP_PAD_')
# glibc's malloc_trim where the kept heap's free pages go back, and the resident set past which they do
# (None: never)
_HEAP = {'trim': None, 'limit': None}


def malloc_from_environment() -> list:
  """The environment's settings of the C library's malloc (MALLOC_ENV, GLIBC_TUNABLES, a
  preloaded allocator), which keep_freed_host_memory leaves alone."""
  chosen = [k for k in MALLOC_ENV if os.environ.get(k)]
  if 'glibc.malloc' in os.environ.get('GLIBC_TUNABLES', ''):
    chosen.append('GLIBC_TUNABLES')
  if 'malloc' in os.environ.get('LD_PRELOAD', ''):
    chosen.append('LD_PRELOAD')
  return chosen


def keep_freed_host_memory() -> str:
  """Make glibc's malloc keep what a step frees for the next step; returns what it did, for the log.

  By default glibc maps a block above a threshold (128 KiB, raised to the size of a freed mapped
  block, at most 32 MiB) with its own mmap and unmaps it on free, and gives the heap's free top
  back to the kernel once it passes twice that threshold. A training step frees its
  activations and allocates them again the next step, so every step faulted them in again,
  page by page, zeroed by the kernel, with the system calls (docs/performance.md). Here blocks
  up to 1 GiB come from the heap and its top is never trimmed, so the next step reuses them.

  The kept heap fragments: each micro batch's tensors land in the holes the last one left,
  never quite where they were, so over a step's micro batches the pages it has touched grow to
  0.2-1.6x the step's transient bytes beyond the live tensors, a different amount each run
  (estimates/memory.py counts the upper end). Where memory is short, trim_heap_past arms
  release_freed_host_memory to hand the heap's free pages back past a bound.
  Process-wide: call it once at start-up (train.py does on the CPU unless
  keep_freed_host_memory=False). Where the environment sets glibc's malloc itself (MALLOC_ENV,
  GLIBC_TUNABLES: e.g. tools/bench_memory.py's threshold), another allocator is preloaded
  (jemalloc, tcmalloc: LD_PRELOAD), or the C library is not glibc, nothing changes.
  """
  chosen = malloc_from_environment()
  if chosen:
    return f'as the environment sets it ({", ".join(chosen)})'
  try:
    libc = ctypes.CDLL(None)
    mallopt, trim = libc.mallopt, libc.malloc_trim
  except (OSError, AttributeError):
    return 'as the C library has it (no mallopt: not glibc)'
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
  for threshold in _KEPT_MMAP_THRESHOLDS:
    if mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1:
      _HEAP.update(trim=trim, limit=None)
      return f'freed memory kept for reuse (blocks up to {threshold >> 20} MiB from the heap)'
  return 'as the C library has it (mallopt refused)'


def trim_heap_past(limit_bytes):
  """Arm release_freed_host_memory: past `limit_bytes` of resident memory the kept heap's free
  pages go back to the kernel. None disarms it (the default: the heap is never trimmed)."""
  _HEAP['limit'] = limit_bytes


def resident_bytes():
  """This process's resident set now (Linux; None where /proc can't tell)."""
  try:
    with open('/proc/self/statm', encoding='ascii') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return None


def keeps_host_heap() -> bool:
  """Whether keep_freed_host_memory took effect in this process (glibc, the environment silent)."""
  return _HEAP['trim'] is not None


def trims_host_heap() -> bool:
  """Whether release_freed_host_memory can do anything in this process (the passes check it
  only where it does: GPU and XLA steps, and CPU runs with memory to spare, carry none of it)."""
  return _HEAP['trim'] is not None and _HEAP['limit'] is not None


def release_freed_host_memory():
  """Hand the kept heap's free pages back to the kernel once the resident set is past
  trim_heap_past's bound (or /proc can't tell); nothing otherwise, or where it is not armed.
  The passes call it between layers (parallel/passes.py)."""
  if not trims_host_heap():
    return
  resident = resident_bytes()
  if not resident or resident > _HEAP['limit']:
    _HEAP['trim'](0)


TRIM_SETTINGS = {'auto': 'auto', 'true': True, 'on': True, 'false': False, 'off': False}


def trim_setting(config):
  """config.trim_host_heap as 'auto', True or False (a flag may bring it as a string); the value
  itself where it is none of them (configs/validate.py names it)."""
  value = config.get('trim_host_heap', 'auto')
  return TRIM_SETTINGS.get(value.lower(), value) if isinstance(value, str) else value


def configure_host_malloc(config):
  """keep_freed_host_memory() where config.keep_freed_host_memory is on and the run's device is the
  CPU (a GPU's or XLA's tensors are not the host C library's); what it did, or None. Whether the
  kept heap is trimmed is decided once the run's estimate is known (memory_check.heap_trim)."""
  _HEAP.update(trim=None, limit=None)
  if config.get('keep_freed_host_memory', True) and kind(config.device) == 'cpu':
    return keep_freed_host_memory()
  return None


def step_done_marker(device: torch.device):
  """A function, made as a step's work has all been queued, that returns the time
  (time.perf_counter) that work finished, waiting for it if need be. The CPU ran it before this
  returns; CUDA records an event behind it; XLA's step is one graph, done once its outputs
  reached the host (call it after reading them)."""
  if device.type == 'cuda':
    event = torch.cuda.Event()
    event.record()
    return lambda: (event.synchronize(), time.perf_counter())[1]
  if device.type == 'xla':
    return time.perf_counter
  now = time.perf_counter()
  return lambda: now


def step_boundary(device: torch.device):
  """The end of an optimizer step: on XLA the traced step becomes one graph (compiled once,
  then cached); eager devices have nothing to do."""
  if device.type == 'xla':
    xla.step_boundary()


def to_host(tensors: dict, copy=False) -> dict:
  """{name: CPU tensor}: XLA tensors in one batched transfer; `copy` guarantees tensors that
  do not share memory with the originals (CPU tensors are otherwise returned as they are)."""
  if any(host_values.is_fake(t) for t in tensors.values()):     # a traced step: no values to read
    return {n: host_values.read(t, None, 'the logged values (a trace has none: logged as nan)',
                                lambda t=t: host_values.placeholder(t)) for n, t in tensors.items()}
  xla_names = [n for n, t in tensors.items() if t.device.type == 'xla']
  out = xla.to_host({n: tensors[n].detach() for n in xla_names}) if xla_names else {}
  out.update({n: t.detach().to('cpu', copy=copy) for n, t in tensors.items() if n not in out})
  return {n: out[n] for n in tensors}


def measured_matmul_flops(device: torch.device, dtype=torch.float32, n=1024, repeats=5) -> float:
  """Best-of-`repeats` FLOP/s of an n x n matmul: the CPU's practical peak for MFU."""
  a = torch.randn(n, n, device=device, dtype=dtype)
  b = torch.randn(n, n, device=device, dtype=dtype)
  (a @ b).sum().item()
  best = float('inf')
  for _ in range(repeats):
    synchronize(device)
    start = time.perf_counter()
    a @ b
    synchronize(device)
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def peak_flops(device: torch.device, dtype=torch.float32) -> tuple:
  """(peak FLOP/s, where it came from). CUDA: datasheet bf16 dense; else a measured matmul."""
  if device.type == 'cuda':
    name = torch.cuda.get_device_name(device)
    flops = datasheet_peak(name)
    if flops is not None:
      return flops, f'{name} datasheet bf16 dense'
  return measured_matmul_flops(device, dtype), f'measured {dtype} 1024^3 matmul on {device.type}'
