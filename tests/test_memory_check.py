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


def _cgroups(tmp_path, line, files):
  """A /proc/self/cgroup of one `line` and a cgroup mount holding `files` (path -> text)."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  (tmp_path / 'cgroup').write_text(line + '\n')
  for path, text in files.items():
    (tmp_path / 'fs' / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / 'fs' / path).write_text(text)
  return dict(proc_cgroup=str(tmp_path / 'cgroup'), root=str(tmp_path / 'fs'))


def test_a_cgroup_memory_limit_is_what_the_ranks_have_left(tmp_path):
  gib = 2**30
  v2 = _cgroups(tmp_path / 'v2', '0::/job', {'job/memory.max': f'{8 * gib}\n', 'job/memory.current': f'{3 * gib}\n'})
  assert memory_check.cgroup_room_bytes(**v2) == 5 * gib
  v1 = _cgroups(tmp_path / 'v1', '4:memory:/job', {'memory/job/memory.limit_in_bytes': f'{4 * gib}\n',
                                                   'memory/job/memory.usage_in_bytes': f'{gib}\n'})
  assert memory_check.cgroup_room_bytes(**v1) == 3 * gib
  # a container shows its own cgroup at the mount's root, under a path it cannot see
  inside = _cgroups(tmp_path / 'in', '0::/outside/job', {'memory.max': f'{2 * gib}', 'memory.current': '0'})
  assert memory_check.cgroup_room_bytes(**inside) == 2 * gib
  unlimited = _cgroups(tmp_path / 'max', '0::/', {'memory.max': 'max', 'memory.current': '5'})
  assert memory_check.cgroup_room_bytes(**unlimited) is None
  v1_unlimited = _cgroups(tmp_path / 'v1max', '4:memory:/', {'memory/memory.limit_in_bytes': '9223372036854771712',
                                                             'memory/memory.usage_in_bytes': '5'})
  assert memory_check.cgroup_room_bytes(**v1_unlimited) is None
  assert memory_check.cgroup_room_bytes(proc_cgroup=str(tmp_path / 'none')) is None


def test_the_kept_heap_is_trimmed_only_where_memory_is_short_or_the_user_asks(monkeypatch):
  from configs import llama_tiny  # pylint: disable=import-outside-toplevel
  from estimates import host_heap, memory  # pylint: disable=import-outside-toplevel
  from parallel import device, mesh as meshes  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(device, '_HEAP', {'trim': lambda pad: 0, 'limit': None})     # as where glibc keeps the heap
  c = llama_tiny.get_config()
  est = memory.estimate(c)
  trimmed = memory.with_heap_trimmed(c, est)
  before = 300 * 2**20

  def choose(setting, budget):
    monkeypatch.setattr(memory_check, 'available_bytes', lambda dev, ranks: (budget, 'the test\'s budget'))
    device.trim_heap_past(None)
    c.trim_host_heap = setting
    return memory_check.heap_trim(c, meshes.Mesh(), est, before) + (device.trims_host_heap(),)

  plenty = choose('auto', 2 * est['total'])
  assert plenty[0] == est and not plenty[2] and plenty[1].startswith('never trimmed (trim_host_heap=auto: ')
  short = choose('auto', est['total'])           # the untrimmed estimate past 90% of the budget
  assert short[0] == trimmed and short[2] and 'memory is short' in short[1]
  assert device._HEAP['limit'] == host_heap.host_heap_limit(trimmed, before)  # pylint: disable=protected-access
  asked = choose(True, 100 * est['total'])
  assert asked[0] == trimmed and asked[2] and 'trim_host_heap=True' in asked[1]
  off = choose(False, est['total'] // 2)
  assert off[0] == est and not off[2] and off[1] == 'never trimmed (trim_host_heap=False)'
  monkeypatch.setattr(device, '_HEAP', {'trim': None, 'limit': None})      # no kept heap: nothing to say
  assert choose('auto', est['total']) == (est, None, False)
