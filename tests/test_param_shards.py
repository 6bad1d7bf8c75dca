"""parallel/param_shards.py: ZeRO-3 trains like one device at every layout it composes with,
keeps 1/dp of the parameters between uses, and resumes across ZeRO stages."""
import pytest

from data.loader import Loader
from optim import update
from parallel import mesh as meshes, param_shards, tensor, training
from tests import world

from configs import validate
from tests import parity

LAYOUTS = {
    'dp2_zero3': (2, {'zero1': True, 'zero_stage': 3}),
    'dp2_zero3_tied': (2, {'zero1': True, 'zero_stage': 3, 'tied': True}),
    'dp2_zero3_lora': (2, {'zero1': True, 'zero_stage': 3, 'lora': 4}),
    'dp2_zero3_moe_ep2': (2, {'zero1': True, 'zero_stage': 3, 'moe': 4, 'ep': 2}),
    'dp4_zero3': (4, {'zero1': True, 'zero_stage': 3}),
    'dp2_tp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'tp': 2, 'sp': True}),
    'dp2_pp2_zero3': (4, {'zero1': True, 'zero_stage': 3, 'pp': 2, 'layers': 4}),
}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_zero3_trains_like_one_device(world_size, tmp_path, tmp_path_factory):
  parity.check_layouts(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


def _held_after_a_step():
  """(dict type, bytes of the boxes' storage after a step, owned rows' bytes, whole boxes' bytes)."""
  config = parity.parity_config(zero1=True, zero_stage=3, tied=True)
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
