"""Passes over a rank's micro batches."""
from configs import llama_tiny
from data.loader import Loader
from optim import update
from parallel import mesh as meshes, passes, tensor, training


def test_each_layers_forward_and_backward_first_offer_the_kept_heaps_free_pages_back(monkeypatch):
  calls = []
  monkeypatch.setattr(passes.devices, 'release_freed_host_memory', lambda: calls.append(len(calls)))
  monkeypatch.setattr(passes.devices, 'trims_host_heap', lambda: True)      # as on a CPU run that trims
  c = llama_tiny.get_config('test')
  c.data.global_batch_size = 3 * c.data.micro_batch_size
  mesh = meshes.Mesh()
  params = training.init_params(c, mesh)
  updater = update.Updater(params, c, mesh, training.placement(c, mesh))
  micro_batches = Loader(c, 'train').global_batch(0)
  assert len(micro_batches) == 3
  passes.forward_backward(params, micro_batches, c, mesh, tensor.config_ops(c, mesh), updater.recipe)
  # each micro batch: each layer's forward, before the head, after the loss, each layer's backward
  assert len(calls) == 3 * (2 * c.model.num_layers + 2)


def test_where_nothing_trims_the_layers_run_unwrapped(monkeypatch):
  calls = []
  monkeypatch.setattr(passes.devices, 'release_freed_host_memory', lambda: calls.append(len(calls)))
  monkeypatch.setattr(passes.devices, 'trims_host_heap', lambda: False)     # GPU, XLA, trim_host_heap=False
  c = llama_tiny.get_config('test')
  mesh = meshes.Mesh()
  params = training.init_params(c, mesh)
  updater = update.Updater(params, c, mesh, training.placement(c, mesh))
  micro_batches = Loader(c, 'train').global_batch(0)
  passes.forward_backward(params, micro_batches, c, mesh, tensor.config_ops(c, mesh), updater.recipe)
  assert len(calls) == len(micro_batches)          # only the no-op after each loss
