"""parallel/grad_buffer.py: gradients accumulate into the buckets themselves, DP reductions
start during the backward, and neither the overlap nor ZeRO-1's collective changes a bit."""
import numpy as np
import pytest
import torch

from data.loader import Loader
from model import lora
from optim import update
from parallel import mesh as meshes, passes, tensor, training
from tests import parity, world

VARIANTS = [(zero1, collective, overlap) for zero1, collective in
            ((False, 'auto'), (True, 'reduce_scatter'), (True, 'all_reduce')) for overlap in (True, False)]


def _config(zero1=False, collective='auto', overlap=True, precision='fp32'):
  config = parity.parity_config(zero1=zero1, precision=precision, tied=True)
  d = config.distributed_strategy
  d.zero1_collectives, d.overlap_grad_reduce = collective, overlap
  config.bucket_size_collectives = 0.01     # several buckets: overlap has something to overlap
  return config


def _variants(precision):
  return {v: parity.steps_on_rank(_config(*v, precision=precision), 3) for v in VARIANTS}


def test_overlap_and_zero1_collective_change_no_bit():
  """fp32 and mixed_precision, one after another in one world."""
  precisions = ('fp32', 'mixed_precision')
  for rank in world.run(world.in_turn, 2, [(_variants, (p,)) for p in precisions]):
    for precision, got in zip(precisions, rank):
      for zero1 in (False, True):
        same = [v for v in VARIANTS if v[0] == zero1]
        for v in same[1:]:
          for name, value in got[same[0]].items():
            np.testing.assert_array_equal(got[v][name], value, err_msg=f'{precision} {name}: {v} vs {same[0]}')


def _launched_during_backward(overlap, expected=None):
  config = _config(overlap=overlap)
  mesh = meshes.init(config)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  batches = Loader(config, 'train', mesh.dp_rank, mesh.dp).global_batch(0)
  updater.start(expected or len(batches))
  try:
    passes.forward_backward(params, batches, config, mesh, tensor.make_ops(mesh))
  except RuntimeError as e:
    return str(e)
  return updater.grads.launched, len(updater.grads.buckets)


def _launch_counts():
  return {overlap: _launched_during_backward(overlap) for overlap in (True, False)} | {
      'too_many': _launched_during_backward(True, expected=1)}


def test_buckets_are_reduced_during_the_backward_and_a_late_gradient_is_an_error():
  for got in world.run(_launch_counts, 2):
    launched, buckets = got[True]
    assert buckets > 3 and launched == buckets       # every bucket launched before backward returned
    assert got[False] == (0, buckets)                # off: all of them wait for `gradients()`
    assert 'arrived after its bucket was reduced' in got['too_many'], got['too_many']


@pytest.mark.parametrize('precision', ['fp32', 'mixed_precision', 'bf16SR'])
def test_gradients_live_in_the_buckets_and_nowhere_else(precision):
  config = _config(precision=precision)
  mesh = meshes.Mesh()
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  batches = Loader(config).global_batch(0)
  updater.start(len(batches))
  passes.forward_backward(params, batches, config, mesh, tensor.make_ops(mesh))
  assert all(p.grad is None for p in params.values())
  storages = {b.data.untyped_storage().data_ptr() for b in updater.grads.buckets}
  grads = updater.gradients()
  assert set(grads) == set(params)
  for name, g in grads.items():
    assert g.untyped_storage().data_ptr() in storages, name
    assert g.dtype == updater.recipe.grad_acc_dtype and g.shape == params[name].shape, name
  assert updater.grads.bytes() == sum(p.numel() * g.element_size() for p, g in zip(params.values(), grads.values()))


def test_fp32_adapters_keep_fp32_gradients_under_bf16_accumulation():
  config = parity.parity_config(lora=4, precision='bf16SR')
  mesh = meshes.Mesh()
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh, trainable=set(lora.trainable(config.model, params)))
  batches = Loader(config).global_batch(0)
  updater.start(len(batches))
  passes.forward_backward(params, batches, config, mesh, tensor.make_ops(mesh))
  grads = updater.gradients()
  assert grads and all(lora.is_adapter(n) for n in grads)
  for name, g in grads.items():
    assert g.dtype == params[name].dtype == torch.float32, name      # not summed in bf16
