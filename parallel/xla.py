"""What XLA devices (torch-xla: Trainium, TPU, the CPU PJRT client) need beyond the device layer.

torch-xla traces ops lazily and compiles each distinct graph once. The loop therefore cuts the
graph once per optimizer step (`step_boundary`), never reads a device value inside a step
(the finite check of the update stays in the graph, see optim/update.py), and fetches
metrics on log steps only, when the step's graph has already run. Nothing here imports
torch_xla unless the device is an XLA one, so the core runs without it.

NxD Training's compiler-facing top-level keys map to what torch-xla has (`runtime_settings`):
  compiler_flags                    NEURON_CC_FLAGS (neuronx-cc, Trainium only)
  compiler_cache_url                torch_xla.runtime.initialize_cache (persistent compilation
                                    cache, every PJRT device); NEURON_COMPILE_CACHE_URL on Neuron
  aync_exec_max_inflight_requests   NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS (Neuron runtime)
  neuron_rt_exec_timeout            NEURON_RT_EXEC_TIMEOUT (Neuron runtime)
  neuron_experimental_compress_rg   NEURON_EXPERIMENTAL_COMPRESS_RG (Neuron runtime)
Environment variables must be set before the runtime starts: `configure` runs before the
device is first touched.
"""
import os

import torch

NEURON_ENV = {   # NxD key -> the Neuron variable it sets
    'compiler_flags': 'NEURON_CC_FLAGS',
    'aync_exec_max_inflight_requests': 'NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS',
    'neuron_rt_exec_timeout': 'NEURON_RT_EXEC_TIMEOUT',
    'neuron_experimental_compress_rg': 'NEURON_EXPERIMENTAL_COMPRESS_RG',
}


def is_xla(device) -> bool:
  return torch.device(device).type == 'xla'


def pjrt_device() -> str:
  return os.environ.get('PJRT_DEVICE', '')


def runtime_settings(config, device_name) -> list:
  """[(key, value, what it does here)] for the compiler-facing keys that are set; a key that
  does nothing on this device says so (reported at start-up, never silently dropped)."""
  out = []
  neuron = device_name == 'xla' and pjrt_device() == 'NEURON'
  for key, env in NEURON_ENV.items():
    value = config.get(key)
    if value in (None, '', 0, False):
      continue
    out.append((key, value, f'sets {env}' if neuron else
                f'not applicable: a Neuron setting ({env}); this run is on {_where(device_name)}'))
  url = config.get('compiler_cache_url')
  if url:
    out.append(('compiler_cache_url', url, ('persistent compilation cache (torch_xla.runtime.initialize_cache'
                                            + (', NEURON_COMPILE_CACHE_URL)' if neuron else ')'))
                if device_name == 'xla' else f'not applicable: no compilation on {_where(device_name)}'))
  return out


def _where(device_name):
  return f'xla ({pjrt_device() or "PJRT_DEVICE unset"})' if device_name == 'xla' else device_name


def configure(config, device_name):
  """Apply the compiler-facing keys before the XLA runtime starts; returns runtime_settings."""
  settings = runtime_settings(config, device_name)
  if device_name != 'xla':
    return settings
  neuron = pjrt_device() == 'NEURON'
  for key, value, effect in settings:      # runtime_settings already decided what each key does
    if key in NEURON_ENV and effect.startswith('sets '):
      os.environ[NEURON_ENV[key]] = str(int(value) if isinstance(value, bool) else value)
  url = config.get('compiler_cache_url')
  if url:
    if neuron:
      os.environ['NEURON_COMPILE_CACHE_URL'] = url
    import torch_xla.runtime as xr  # pylint: disable=import-outside-toplevel
    try:
      xr.initialize_cache(url, readonly=False)
    except RuntimeError as e:            # the cache can be set once per process
      if 'already' not in str(e).lower():
        raise
  return settings


def device():
  import torch_xla  # pylint: disable=import-outside-toplevel
  return torch_xla.device()


def step_boundary():
  """Cut the traced graph: everything queued so far becomes one compiled, cached graph."""
  import torch_xla  # pylint: disable=import-outside-toplevel
  torch_xla.sync()


def wait():
  import torch_xla.core.xla_model as xm  # pylint: disable=import-outside-toplevel
  xm.wait_device_ops()


def compiles() -> int:
  """Graphs compiled so far in this process (torch-xla's UncachedCompile counter)."""
  import torch_xla.debug.metrics as met  # pylint: disable=import-outside-toplevel
  return int(met.counter_value('UncachedCompile') or 0)


def to_host(tensors: dict) -> dict:
  """{name: CPU tensor} of XLA tensors in one batched transfer (not one round trip each)."""
  import torch_xla  # pylint: disable=import-outside-toplevel
  names = list(tensors)
  values = torch_xla._XLAC._xla_get_cpu_tensors([tensors[n] for n in names])  # pylint: disable=protected-access
  return dict(zip(names, values))


def checkpoint(fn, *args):
  """Activation recompute that works under XLA (torch.utils.checkpoint needs a device module
  torch-xla does not register); torch-xla's is reentrant only."""
  import torch_xla.utils.checkpoint as xla_checkpoint  # pylint: disable=import-outside-toplevel
  return xla_checkpoint.checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=False)


def init_process_group(timeout):
  """torch.distributed over XLA collectives, as NxD Training runs on Trainium: torchrun sets
  RANK / WORLD_SIZE / MASTER_ADDR, the `xla` backend does the collectives."""
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  import torch_xla.distributed.xla_backend  # pylint: disable=import-outside-toplevel,unused-import
  dist.init_process_group('xla', init_method='xla://', timeout=timeout)
