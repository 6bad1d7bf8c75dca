"""estimates/memory_check.py: the layouts that fit a budget, what a rank may use."""
import torch

from configs import llama7b
from estimates import memory_check


def test_fitting_layouts_are_valid_fit_the_budget_and_come_smallest_first():
  from configs import validate  # pylint: disable=import-outside-toplevel
  c = llama7b.get_config()
  c.data.global_batch_size = 64
  fits = memory_check.fitting_layouts(c, 8, 40 * 2**30, validate.check)
  assert fits and [need for _, need in fits] == sorted(need for _, need in fits)
  assert all(need <= 40 * 2**30 for _, need in fits)
  assert 'tp=1 pp=1' not in [name for name, _ in fits]      # the whole model on each rank: 100+ GiB
  assert memory_check.fitting_layouts(c, 8, 2**30, validate.check) == []
  assert memory_check.fitting_layouts(c, 1, 40 * 2**30, validate.check) == []


def test_available_bytes_splits_host_ram_between_local_ranks(monkeypatch):
  import torch  # pylint: disable=import-outside-toplevel
  assert memory_check.host_available_bytes() > 0
  monkeypatch.setattr(memory_check, 'host_available_bytes', lambda: 8 * 2**30)
  assert memory_check.available_bytes(torch.device('cpu'), 4) == (2 * 2**30, 'available host RAM / 4 local rank(s)')


def test_the_measured_peak_is_set_against_the_estimate_less_the_process_before_the_run():
  from parallel import mesh as meshes  # pylint: disable=import-outside-toplevel
  peak = memory_check.measured_peak_bytes(torch.device('cpu'))
  assert peak > 100 * 2**20                                  # torch alone is more than this
  line = memory_check.peak_report(meshes.Mesh(), 2**20, peak - 2**20)
  grown = float(line.split('rank 0: ')[1].split(' MiB')[0])
  assert line.startswith('peak RSS over the process before the run, against the start-up estimate: rank 0: ')
  assert grown >= 1.0 and '% of 1 MiB;' in line           # the peak only grows
