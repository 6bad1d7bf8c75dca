"""estimates/live_bytes.py: live storage bytes by category, their peak, activations as what
autograd saves."""
import torch

from estimates import live_bytes


def test_storages_count_once_until_freed_and_the_peak_keeps_its_parts():
  with live_bytes.LiveBytes() as live:
    a = torch.ones(256)                 # 1 KiB
    view = a[:10].view(2, 5)            # the same storage: nothing more
    assert live.total == 1024 and view.untyped_storage().nbytes() == 1024
    b = torch.zeros(512)                # 2 KiB more
    del a, view
    assert live.total == 2048           # freed with its last reference
    del b
  assert live.peak == 3072 and live.at_peak == dict(live.now, transients=3072) and live.total == 0


def test_held_tensors_take_their_category_and_saved_ones_count_as_activations():
  with live_bytes.FakeLiveBytes() as live, live.saving():
    weight = torch.ones(64, 64, requires_grad=True)
    live.hold([weight], 'params')
    x = torch.ones(8, 64)
    y = (x @ weight).relu()     # the matmul keeps x (for the weight's gradient), relu its output
    assert live.now['params'] == 64 * 64 * 4 and live.now['activations'] == 2 * 8 * 64 * 4
    y.sum().backward()
  assert live.at_peak['params'] == 64 * 64 * 4 and live.peak >= live.at_peak['activations'] + live.at_peak['params']
