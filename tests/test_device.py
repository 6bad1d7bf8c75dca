"""The device layer."""
import json
import sys

import pytest
import torch

from parallel import device
from tests import procs


def test_cpu_resolution_backend_and_peak():
  d = device.resolve('cpu')
  assert d == torch.device('cpu') and device.backend(d) == 'gloo'
  peak, source = device.peak_flops(d)
  assert peak > 1e8 and 'measured' in source
  assert device.backend(torch.device('cuda', 0)) == 'nccl'


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the error on a machine without CUDA')
def test_cuda_request_without_cuda_is_a_clear_error():
  with pytest.raises(RuntimeError, match='device=cpu'):
    device.resolve('cuda')


def test_xla_request_without_torch_xla_names_the_fix():
  try:
    import torch_xla  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    pytest.skip('torch-xla is installed here')
  except ImportError:
    pass
  with pytest.raises(RuntimeError, match='torch-xla'):
    device.resolve('xla')


def test_datasheet_peaks_tell_the_h100_parts_apart():
  # names as torch.cuda.get_device_name gives them (the first seen on the H100 of docs/performance.md)
  assert device.datasheet_peak('NVIDIA H100 80GB HBM3') == 989e12
  assert device.datasheet_peak('NVIDIA H100 PCIe') == 756e12
  assert device.datasheet_peak('NVIDIA H100 NVL') == 835e12
  assert device.datasheet_peak('NVIDIA A100-SXM4-80GB') == 312e12
  assert device.datasheet_peak('NVIDIA GeForce GTX 1080') is None      # measured instead



_FAULTS = '''
import ctypes, json, resource
from parallel import device

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
MIB = 1 << 20

def faults_of_a_step():
  # a step's activations: 6 x 16 MiB written, then freed last first (each joins the heap's top)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  blocks = [libc.malloc(16 * MIB) for _ in range(6)]
  for b in blocks:
    ctypes.memset(b, 1, 16 * MIB)
  for b in reversed(blocks):
    libc.free(b)
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

libc.free(libc.malloc(20 * MIB))        # glibc's threshold follows a freed mapped block: 16 MiB now come from the heap
plain = [faults_of_a_step() for _ in range(4)]
kept = device.keep_freed_host_memory()
print(json.dumps({'plain': plain, 'kept': kept, 'after': [faults_of_a_step() for _ in range(4)]}))
'''


def test_keep_freed_host_memory_reuses_the_heap_instead_of_faulting_pages_in():
  # in a child: mallopt is process-wide
  out = procs.run([sys.executable, '-c', _FAULTS], timeout=120)
  assert out.returncode == 0, out.stderr
  r = json.loads(out.stdout.splitlines()[-1])
  if not r['kept']:
    pytest.skip('the C library is not glibc')
  # glibc's default gives the freed top back to the kernel: every step faults its 96 MiB in
  # again, one fault per 4 KiB page
  assert min(r['plain']) > 5 * 4096, r
  # kept: the first step after it grows the heap, every later one reuses it
  assert r['after'][1:] == [0, 0, 0], r
