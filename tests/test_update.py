"""optim/update.py: the one update path, owned rows, frozen parameters, named state."""
import torch

from data.loader import Loader
from numerics import precision
from optim import update
from parallel import mesh as meshes, tensor, training
from tests import parity


def _stepped(trainable=None, precision_type='fp32'):
  config = parity.parity_config()
  config.precision.type = precision_type
  mesh = meshes.Mesh()
  params = training.init_params(config, mesh)
  before = {n: p.detach().clone() for n, p in params.items()}
  updater = update.Updater(params, config, mesh, trainable=trainable)
  batches = Loader(config).global_batch(0)
  training.train_step(params, updater, batches, config, 0, mesh, tensor.make_ops(mesh))
  return params, before, updater, config


def test_frozen_parameters_get_no_gradient_state_or_rows_and_stay_put():
  trainable = {'layers.0.self_attn.q_proj.weight', 'layers.1.mlp.down_proj.weight'}
  params, before, updater, _ = _stepped(trainable)
  for name, p in params.items():
    if name in trainable:
      assert not torch.equal(p.detach(), before[name]), name
    else:
      assert torch.equal(p.detach(), before[name]) and not p.requires_grad, name
  assert set(updater.master) == set(updater.rows) == trainable
  assert {a.split('.', 2)[2] for a in updater.named_state() if a.startswith('optim.')} == trainable
  assert updater.state_bytes() == sum(2 * 4 * params[n].numel() for n in trainable)   # Adam moments


def test_named_state_round_trips_into_a_fresh_updater():
  for precision_type in ('fp32', 'mixed_precision', 'bf16SR'):
    params, _, updater, config = _stepped(precision_type=precision_type)
    state = {k: v.clone() for k, v in updater.named_state().items()}
    assert any(k.startswith('master.') for k in state) == (precision_type == 'mixed_precision')
    fresh = update.Updater({n: p.detach().clone() for n, p in params.items()}, config, meshes.Mesh())
    fresh.load_named_state(state, updater.optimizer_step())
    assert fresh.optimizer_step() == updater.optimizer_step() == 1.0
    for key, value in state.items():
      if key.startswith('optim.'):
        assert torch.equal(fresh.named_state()[key], value), key


def test_owned_rows_are_the_zero1_shards():
  assert update.owned_rows(10, 4, 3) == update.Rows(slice(9, 10), 3)
  assert update.owned_rows(10, 1, 0) == update.Rows(slice(0, 10), 10)


def _sr_step(recipe, world_size):
  """One (stochastically rounded) update from the same global gradient, on this rank's shards."""
  config = parity.parity_config(zero1=world_size > 1, precision=recipe)
  mesh = meshes.init(config)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh, training.placement(config, mesh))
  # exactly representable halves: the reduce-scatter sum is exact, so only the rounding could differ
  grads = {n: torch.randint(-64, 64, p.shape, generator=torch.Generator().manual_seed(i)).float() / 1024
           / world_size for i, (n, p) in enumerate(params.items())}
  for name, grad in grads.items():
    updater.grads.accumulate(name, grad)
  updater.step(updater.gradients(), 1e-2, 0)
  return {n: p.detach().float().numpy() for n, p in params.items()}


def _sr_steps(recipes, world_size):
  # every fp32 parameter of the tiny model through the one-pass step (else torch's for these sizes)
  precision.FUSED_FP32_MIN_NUMEL = 0
  return {recipe: _sr_step(recipe, world_size) for recipe in recipes}


def test_stochastic_rounding_is_the_same_at_every_zero1_layout(monkeypatch):
  # fp32 and mixed_precision too: the one-pass fp32 Adam step is the same arithmetic at every
  # element's position, so ZeRO-1's shards step bit for bit as the whole does
  from tests import world  # pylint: disable=import-outside-toplevel
  recipes = ('bf16SR', 'mixed_precisionSR', 'fp32', 'mixed_precision')
  monkeypatch.setattr(precision, 'FUSED_FP32_MIN_NUMEL', 0)
  single = _sr_steps(recipes, 1)                  # one process: this one
  for got in world.run(_sr_steps, 2, recipes, 2):
    for recipe in recipes:
      for name, value in single[recipe].items():
        assert (got[recipe][name] == value).all(), (recipe, name)


def test_bf16SR_keeps_bf16_moments_and_no_fp32_copy_between_steps():
  params, before, updater, _ = _stepped(precision_type='bf16SR')
  n = sum(p.numel() for p in params.values())
  assert updater.state_bytes() == 2 * 2 * n                     # two bf16 moments, nothing else
  assert all(m.dtype == torch.bfloat16 for m in updater.master.values())
  for name, m in updater.master.items():                         # the rows are the parameter's again
    assert m.data_ptr() == params[name].data_ptr(), name
  state = updater.named_state()
  assert state and all(v.dtype == torch.bfloat16 for v in state.values())
  assert any(not torch.equal(p.detach(), before[n]) for n, p in params.items())


def test_fp32_rows_step_in_one_pass_as_torchs_adamw_does_to_fp32_rounding(monkeypatch):
  for precision_type in ('fp32', 'mixed_precision'):
    params, _, updater, _ = _stepped(precision_type=precision_type)
    assert updater._fusable() == frozenset()                 # the tiny model's parameters: torch's step
    monkeypatch.setattr(precision, 'FUSED_FP32_MIN_NUMEL', 2048)
    params, _, updater, _ = _stepped(precision_type=precision_type)
    large = {n for n, p in params.items() if p.numel() >= 2048}
    assert large and updater._fusable() == large != set(params)
    # mixed_precision: the pass writes the bf16 parameter too, rounded to nearest as the copy is
    assert updater.narrowed_in_pass == (large if precision_type == 'mixed_precision' else frozenset())
    for name in updater.narrowed_in_pass:
      assert torch.equal(params[name].detach(), updater.master[name].to(params[name].dtype)), name
    monkeypatch.setattr(update.sr_update, 'fusable', lambda *args, **kwargs: False)
    reference, _, unfused, _ = _stepped(precision_type=precision_type)
    assert unfused._fusable() == frozenset()
    monkeypatch.undo()
    # torch's vectorized lerp_ and addcmul_ contract into fmas, the one pass does not: an fp32
    # ulp or so in the moments, as little in the parameters
    for name, p in params.items():
      torch.testing.assert_close(p, reference[name], rtol=1e-6, atol=1e-7, msg=name)
    for key, value in updater.named_state().items():
      torch.testing.assert_close(value, unfused.named_state()[key], rtol=1e-5, atol=1e-9, msg=key)
