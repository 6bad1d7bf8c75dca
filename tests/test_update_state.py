"""optim/update_state.py: an Updater's masters and optimizer state go out under checkpoint names
and come back exactly into another Updater."""
import torch

from data.loader import Loader
from optim import update
from parallel import mesh as meshes, tensor, training
from tests import parity


def _updater(config, mesh):
  params = training.init_params(config, mesh)
  return params, update.Updater(params, config, mesh)


def test_named_state_loads_back_exactly_into_a_fresh_updater():
  config = parity.parity_config(precision='mixed_precision')
  mesh = meshes.init(config)
  params, trained = _updater(config, mesh)
  training.train_step(params, trained, Loader(config, 'train', 0, 1).global_batch(0), config, 0, mesh,
                      tensor.make_ops(mesh))
  saved = {k: v.clone() for k, v in trained.named_state().items()}
  assert trained.state_keys() == ['exp_avg', 'exp_avg_sq'] and trained.optimizer_step() == 1.0
  assert any(k.startswith('master.') for k in saved) and trained.state_bytes() > 0
  _, fresh = _updater(config, mesh)
  fresh.load_named_state(saved, trained.optimizer_step())
  loaded = fresh.named_state(trained.state_keys())
  assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
  assert fresh.optimizer_step() == 1.0
