"""The device layer."""
import pytest
import torch

from parallel import device


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

