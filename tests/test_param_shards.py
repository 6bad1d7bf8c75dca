"""parallel/param_shards.py: ZeRO-3 trains like one device at every layout it composes with
(HSDP too), keeps its own rows of the parameters between steps, prefetches without changing a
bit, and refuses what it does not run with (resume across stages: tests/test_session.py)."""
import pytest
import torch

from configs import validate
from data.loader import Loader
from optim import update
from parallel import mesh as meshes, param_shards, tensor, training
from tests import parity, world

LAYOUTS = {
    'dp2_zero3': (2, {'zero1': True, 'zero_stage': 3}),
    'dp2_zero3_tied': (2, {'zero1': True, 'zero_stage': 3, 'tied': True}),
    'dp2_zero3_lora': (2, {'zero1': True, 'zero_stage': 3, 'lora': 4}),
    'dp2_zero3_moe_ep2': (2, {'zero1': True, 'zero_stage': 3, 'moe': 4, 'ep': 2}),
    'dp4_zero3': (4, {'zero1': True, 'zero_stage': 3}),
    'dp2_tp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'tp': 2, 'sp': True}),
    'dp2_pp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'pp': 2, 'layers': 4}),
    'dp2_pp2_vp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'pp': 2, 'vp': 2, 'layers': 4}),
    'dp2_cp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'cp': 2}),
    'dp4_hsdp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'shard': 2}),
    'dp4_hsdp2_zero3_kept_full_recompute': (4, {'zero1': True, 'zero_stage': 3, 'shard': 2, 'reshard': False,
                                                'recompute': 'full'}),
    'dp2_zero3_selective_recompute': (2, {'zero1': True, 'zero_stage': 3, 'recompute': 'selective'}),
    'dp2_zero3_whole_grads': (2, {'zero1': True, 'zero_stage': 3, 'per_micro_batch': False}),
    'dp2_zero3_gathered_once': (2, {'zero1': True, 'zero_stage': 3, 'per_micro_batch': False, 'reshard_backward': False}),
}

# the bf16 recipes and FP8 at ZeRO-3, held to tests/test_zero.py's and tests/test_fp8.py's tolerances
PRECISION_LAYOUTS = {
    'bf16SR_dp2_zero3': (2, {'zero1': True, 'zero_stage': 3, 'precision': 'bf16SR'}),
    'mixed_precision_dp2_zero3': (2, {'zero1': True, 'zero_stage': 3, 'precision': 'mixed_precision'}),
}
FP8_LAYOUTS = {
    'fp8_tensorwise_dp2_zero3': (2, {'zero1': True, 'zero_stage': 3, 'precision': 'bf16SR', 'fp8': 'tensorwise',
                                     'steps': 5}),
}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_zero3_trains_like_one_device(world_size, tmp_path, tmp_path_factory):
  parity.check_layouts(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


def test_zero3_trains_like_one_device_in_bf16_and_fp8(tmp_path, tmp_path_factory):
  parity.check_layouts(PRECISION_LAYOUTS, tmp_path / 'bf16', tmp_path_factory, loss_rtol=5e-3, param_atol=5e-2,
                       norm_rtol=0.25)
  parity.check_layouts(FP8_LAYOUTS, tmp_path / 'fp8', tmp_path_factory, loss_rtol=5e-3,
                       param_atol=2 * parity.parity_config().model.optim.lr * 5, norm_rtol=0.25)


def _held_after_a_step(shard=0):
  """(dict type, bytes of the boxes' storage after a step, owned rows' bytes, whole boxes' bytes)."""
  config = parity.parity_config(zero1=True, zero_stage=3, tied=True, shard=shard)
  mesh = meshes.init(config)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  batches = Loader(config, 'train', mesh.dp_rank, mesh.dp).global_batch(0)
  training.train_step(params, updater, batches, config, 0, mesh, tensor.make_ops(mesh))
  shards = param_shards.shards_of(params)
  return (type(params).__name__, sum(p.untyped_storage().nbytes() for p in params.values()), shards.bytes(),
          sum(p.numel() * p.element_size() for p in params.values()))


def test_zero3_holds_its_own_rows_of_the_parameters_between_steps():
  for kind, stored, owned, whole in world.run(_held_after_a_step, 2):
    assert kind == 'ShardedParams' and stored == 0
    assert whole / 2 <= owned <= whole / 2 + 1024        # half the rows, but for a padded row or two
  for _, stored, owned, whole in world.run(_held_after_a_step, 4, 2):    # HSDP: 2 replicas of 2 shards
    assert stored == 0 and whole / 2 <= owned <= whole / 2 + 1024


def test_what_zero3_does_not_run_with_is_refused_naming_the_fix():
  for key, value, names in [('device', 'xla', 'device=xla'), ('model.compile', True, 'model.compile=True'),
                            ('model.objective', 'dpo', "model.objective='dpo'")]:
    config = parity.parity_config(zero1=True, zero_stage=3)
    section, _, leaf = key.rpartition('.')
    (config[section] if section else config)[leaf] = value
    assert any(p.startswith(f'distributed_strategy.zero_stage=3 with {names}: not built') and 'zero_stage=2' in p
               for p in validate.check(config, 2)), key
  config = parity.parity_config(zero1=True, zero_stage=3, lora=4)
  config.model_alignment_strategy.peft.merge_lora = True
  assert any('merge_lora=True: not built (merging needs whole base weights' in p for p in validate.check(config, 2))
  config = parity.parity_config(zero1=True, zero_stage=2, reshard=False)
  assert any(p.startswith('distributed_strategy.reshard_after_forward=False is read only with zero_stage=3')
             for p in validate.check(config, 2))
  config = parity.parity_config(zero1=True, zero_stage=2, per_micro_batch=False)
  assert any(p.startswith('distributed_strategy.grad_reduce_per_micro_batch=False is read only with zero_stage=3')
             for p in validate.check(config, 2))


def test_hsdp_shard_size_must_divide_dp_x_cp_and_needs_zero1():
  config = parity.parity_config(zero1=True, shard=3)
  assert any(p.startswith('distributed_strategy.data_parallel_shard_size=3 must divide dp x cp = 4 x 1')
             for p in validate.check(config, 4))
  config = parity.parity_config(shard=2)
  assert any('data_parallel_shard_size=2 is read only with zero1=True' in p for p in validate.check(config, 4))
  assert not validate.check(parity.parity_config(zero1=True, zero_stage=3, shard=2), 4)


def _owned_after_two_steps(prefetch):
  config = parity.parity_config(zero1=True, zero_stage=3)
  config.distributed_strategy.overlap_param_gather = prefetch
  mesh = meshes.init(config)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  for step in range(2):
    batches = Loader(config, 'train', mesh.dp_rank, mesh.dp).global_batch(step * config.data.global_batch_size)
    training.train_step(params, updater, batches, config, step, mesh, tensor.make_ops(mesh))
  return {n: t.clone() for n, t in param_shards.shards_of(params).shard.items()}


def _with_and_without_prefetch():
  return _owned_after_two_steps(True), _owned_after_two_steps(False)


def test_prefetching_the_next_layer_changes_no_bit():
  for on, off in world.run(_with_and_without_prefetch, 2):
    assert on.keys() == off.keys() and all(torch.equal(on[n], off[n]) for n in on)
