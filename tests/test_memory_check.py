"""estimates/memory_check.py: the layouts that fit a budget, what a rank may use."""
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
