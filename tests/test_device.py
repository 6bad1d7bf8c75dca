"""The device layer."""
import json
import os
import sys

from ml_collections import config_dict
import pytest
import torch

from parallel import device
from tests import procs

MIB = 1 << 20


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


def test_the_backend_comes_from_the_config_or_the_device_and_the_host_group_takes_cpu_tensors():
  assert device.backend(torch.device('cpu'), 'auto') == 'gloo' and device.backend(torch.device('xla'), 'auto') == 'xla'
  assert device.backend(torch.device('cpu'), 'fake') == 'fake'
  # the host group's agreements are CPU tensors: gloo where the run's backend takes none
  assert [device.host_backend(b) for b in ('gloo', 'nccl', 'fake', 'xla')] == ['gloo', 'gloo', 'fake', 'gloo']
  assert device.collective_backend(config_dict.ConfigDict({'device': 'cpu', 'backend': 'auto'})) == 'gloo'
  assert device.collective_backend(config_dict.ConfigDict({'device': 'cuda', 'backend': 'auto'})) == 'nccl'
  assert device.check_backend('gloo') == [] and device.check_backend('auto') == []
  assert '--dry_run=trace' in device.check_backend('fake')[0]      # a run on it would train on nothing
  assert 'not a process-group backend' in device.check_backend('neuronx')[0]


def test_a_device_type_pytorch_does_not_know_is_refused_naming_the_plug_in():
  """AWS's native PyTorch names its device `neuron` (a plug-in's privateuse1 type): not here."""
  assert device.check_name('cpu') == [] and device.check_name('auto') == []
  problem, = device.check_name('neuron')
  assert "device='neuron'" in problem and 'TorchNeuron' in problem
  assert device.check_name('privateuseone') == []       # a known type: a plug-in may back it


def test_datasheet_peaks_tell_the_h100_parts_apart():
  # names as torch.cuda.get_device_name gives them (the first seen on the H100 of docs/performance.md)
  assert device.datasheet_peak('NVIDIA H100 80GB HBM3') == 989e12
  assert device.datasheet_peak('NVIDIA H100 PCIe') == 756e12
  assert device.datasheet_peak('NVIDIA H100 NVL') == 835e12
  assert device.datasheet_peak('NVIDIA A100-SXM4-80GB') == 312e12
  assert device.datasheet_peak('NVIDIA GeForce GTX 1080') is None      # measured instead



# a step's activations in a child (mallopt is process-wide): torch's CPU allocations are
# posix_memalign(64); 6 blocks of 24 MiB written, then freed last first
_FAULTS = """
import ctypes, json, resource
from parallel import device

libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t)
libc.free.argtypes = (ctypes.c_void_p,)
MIB = 1 << 20

def faults_of_a_step():
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  blocks = [ctypes.c_void_p() for _ in range(6)]
  for b in blocks:
    assert libc.posix_memalign(ctypes.byref(b), 64, 24 * MIB) == 0
    ctypes.memset(b, 1, 24 * MIB)
  for b in reversed(blocks):
    libc.free(b)
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = [faults_of_a_step() for _ in range(4)]
did = device.keep_freed_host_memory()
print(json.dumps({'plain': plain, 'did': did, 'after': [faults_of_a_step() for _ in range(5)]}))
"""


def _faults(env):
  out = procs.run([sys.executable, '-c', _FAULTS], timeout=120, env=env,
                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.splitlines()[-1])


def _clean_env():
  env = {k: v for k, v in os.environ.items() if k not in device.MALLOC_ENV and k != 'GLIBC_TUNABLES'}
  return dict(env, LD_PRELOAD='')


def test_keep_freed_host_memory_reuses_freed_blocks_instead_of_faulting_pages_in():
  r = _faults(_clean_env())
  if 'not glibc' in r['did'] or 'refused' in r['did']:
    pytest.skip(f'the C library: {r["did"]}')
  assert 'kept' in r['did'], r
  # glibc's default gives the freed blocks back to the kernel: every step faults its 144 MiB in
  # again, one fault per 4 KiB page (bar the blocks under its risen threshold)
  assert min(r['plain']) > 3 * 24 * 256, r
  # kept: the first step after it grows the heap, and from then on the steps reuse it. A small
  # allocation of the interpreter's between steps can take the front of the freed heap top, so
  # the second step may grow the heap by one block more (the layout of the imports decides it)
  assert r['after'][0] > 0 and sum(r['after'][1:]) <= 24 * 256 and r['after'][2:] == [0, 0, 0], r


def test_keep_freed_host_memory_leaves_an_environment_that_sets_malloc_alone():
  r = _faults(dict(_clean_env(), MALLOC_MMAP_THRESHOLD_='65536'))
  assert r['did'] == 'as the environment sets it (MALLOC_MMAP_THRESHOLD_)', r
  assert min(r['after']) > 3 * 24 * 256, r          # still faulting: nothing changed


# the kept heap after a step: its freed blocks resident until released past a bound, then faulted in again
_RELEASE = _FAULTS.split('plain = ')[0] + """
import sys
resident = device.resident_bytes
plain = [faults_of_a_step() for _ in range(4)]     # as _FAULTS: from the third step on the kept heap is reused
did = device.keep_freed_host_memory()
after = [faults_of_a_step() for _ in range(3)]
before = resident()
device.trim_heap_past(None if sys.argv[1] == 'keep' else before + 64 * MIB)   # not past it: nothing goes back
armed = device.trims_host_heap()
device.release_freed_host_memory()
kept = before - resident()
device.trim_heap_past(None if sys.argv[1] == 'keep' else before - 64 * MIB)   # past it
device.release_freed_host_memory()
print(json.dumps({'did': did, 'armed': armed, 'under the limit': kept, 'released': before - resident(),
                  'next step faults': faults_of_a_step()}))
"""


@pytest.mark.parametrize('trim', [True, False])
def test_the_kept_heap_hands_its_free_pages_back_past_the_bound_only_when_armed(trim):
  out = procs.run([sys.executable, '-c', _RELEASE, 'trim' if trim else 'keep'], timeout=120, env=_clean_env(),
                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.returncode == 0, out.stderr
  r = json.loads(out.stdout.splitlines()[-1])
  if 'not glibc' in r['did'] or 'refused' in r['did']:
    pytest.skip(f'the C library: {r["did"]}')
  assert r['armed'] == trim, r
  assert abs(r['under the limit']) < 8 * MIB, r
  if trim:      # past the bound the step's 144 MiB leave the resident set; the next step faults them in again
    assert r['released'] > 120 * MIB and r['next step faults'] > 5 * 24 * 256, r
  else:         # kept resident and reused
    assert r['released'] < 8 * MIB and r['next step faults'] < 24 * 256, r


def test_host_malloc_is_configured_for_cpu_runs_that_ask_only(monkeypatch):
  monkeypatch.setattr(device, 'keep_freed_host_memory', lambda: 'kept')
  config = lambda keep, dev: config_dict.ConfigDict({'keep_freed_host_memory': keep, 'device': dev})
  assert device.configure_host_malloc(config(True, 'cpu')) == 'kept'
  assert device.configure_host_malloc(config(False, 'cpu')) is None
  assert device.configure_host_malloc(config(True, 'xla')) is None
  assert device.configure_host_malloc(config(True, 'cuda')) is None
  assert not device.trims_host_heap()          # armed only once the estimate says memory is short


@pytest.mark.parametrize('value, setting', [('auto', 'auto'), (True, True), (False, False), ('False', False),
                                            ('true', True), ('off', False), ('sometimes', 'sometimes')])
def test_trim_host_heap_reads_flags_given_as_strings(value, setting):
  assert device.trim_setting(config_dict.ConfigDict({'trim_host_heap': value})) == setting
