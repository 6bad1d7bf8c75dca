"""parallel/grad_shards.py: ZeRO-2 trains like one device at every layout it composes with,
keeps 1/dp of the gradients between backward passes, and resumes across ZeRO stages."""
import pytest
import torch

from configs import validate
from data.loader import Loader
from optim import update
from parallel import mesh as meshes, passes, tensor, training
from tests import parity, world

LAYOUTS = {
    'dp2_zero2': (2, {'zero1': True, 'zero_stage': 2}),
    'dp2_zero2_lora': (2, {'zero1': True, 'zero_stage': 2, 'lora': 4}),
    'dp2_zero2_moe_ep2': (2, {'zero1': True, 'zero_stage': 2, 'moe': 4, 'ep': 2}),
    'dp4_zero2': (4, {'zero1': True, 'zero_stage': 2}),
    'dp2_tp2_zero2': (4, {'zero1': True, 'zero_stage': 2, 'tp': 2, 'sp': True}),
    'dp2_pp2_zero2': (4, {'zero1': True, 'zero_stage': 2, 'pp': 2, 'layers': 4}),
    'dp4_hsdp2_zero2': (4, {'zero1': True, 'zero_stage': 2, 'shard': 2}),      # 2 replicas of 2 shards
    'dp4_hsdp2_zero1': (4, {'zero1': True, 'shard': 2}),
}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_zero2_trains_like_one_device(world_size, tmp_path, tmp_path_factory):
  parity.check_layouts(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


def _held_between_passes():
  """Per stage (2, 1): (owned gradient bytes, whole buckets alive after a pass, buffer class, whole
  buffers kept for reuse, the largest bucket's bytes)."""
  out = []
  for stage in (2, 1):
    config = parity.parity_config(zero1=True, zero_stage=stage, tied=True)
    config.bucket_size_collectives = 0.01        # several buckets
    mesh = meshes.init(config)
    params = training.init_params(config, mesh)
    updater = update.Updater(params, config, mesh)
    batches = Loader(config, 'train', mesh.dp_rank, mesh.dp).global_batch(0)
    updater.start(len(batches))
    passes.forward_backward(params, batches[:1], config, mesh, tensor.make_ops(mesh))
    buffer = updater.grads.buffers[0]
    whole = sum(b.data is not None for b in buffer.buckets)
    owned = sum(b.owned.numel() * b.owned.element_size() for b in buffer.buckets) if stage == 2 else buffer.bytes()
    kept = buffer.bytes() - owned
    out.append((owned, whole, type(buffer).__name__, kept, max(b.data.numel() for b in buffer.buckets) * 4
                if stage == 1 else 0))
  return out


def test_zero2_holds_its_own_part_of_the_gradients_between_passes():
  (sharded, whole, kind, kept, _), (full, _, _, _, largest) = world.run(_held_between_passes, 2)[0]
  assert kind == 'ShardedGradBuffer' and whole == 0      # every whole bucket released at the pass's end
  assert sharded * 2 == full > 0
  assert 0 < kept <= 2 * largest                          # gloo: at most two whole buffers, kept for reuse


def test_a_zero_stage_is_refused_without_zero1_or_when_unknown():
  config = parity.parity_config(zero_stage=2)
  assert any('zero_stage=2 is read only with distributed_strategy.zero1=True' in p for p in validate.check(config))
  config = parity.parity_config(zero1=True, zero_stage=4)
  assert any(p.startswith('distributed_strategy.zero_stage=4 is not one of (1, 2, 3)') for p in validate.check(config))


def _gradients(overlap):
  config = parity.parity_config(zero1=True, zero_stage=2, tied=True)
  config.bucket_size_collectives = 0.01
  config.distributed_strategy.overlap_grad_reduce = overlap
  mesh = meshes.init(config)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  batches = Loader(config, 'train', mesh.dp_rank, mesh.dp).global_batch(0)
  updater.start(len(batches))
  passes.forward_backward(params, batches, config, mesh, tensor.make_ops(mesh))
  return {n: g.clone() for n, g in updater.gradients().items()}


def _with_and_without_overlap():
  return _gradients(True), _gradients(False)


def test_reductions_during_or_after_each_pass_give_the_same_bits():
  for overlapped, after in world.run(_with_and_without_overlap, 2):
    assert overlapped.keys() == after.keys()
    for name, g in overlapped.items():
      assert torch.equal(g, after[name]), name
