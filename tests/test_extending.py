"""docs/extending.md's recipes, each worked through as a fork would: a registered optimizer that
needs whole tensors trains like one device at dp2 + ZeRO-1 and tp2 + SP; a metric added to the
step reaches metrics.jsonl; a per-layer block feature carried in the block's inputs gives under
model.compile what it gives eagerly; a registered data source feeds the loop its samples; every family's
attention declares what the summary, the estimate and the layouts read."""
import collections

import numpy as np
import pytest
import torch

import train
from configs import validate
from data import sources
from data.loader import Loader
from model import param_table, transformer
from optim import optimizers
from parallel import mesh as meshes
from estimates import summary
from tests import parity, world
from tests.test_family_layouts import FAMILIES
from tests.test_train import read_metrics, tiny_config


# --- a new optimizer --------------------------------------------------------------------------

class NormalizedSGD(torch.optim.Optimizer):
  """SGD with momentum, normalized per tensor (Cutkosky & Mehta 2020): m <- b m + (1 - b) g;
  p <- p (1 - lr wd) - lr m / ||m||. The norm is of the whole tensor: under ZeRO-1 and TP each
  rank holds rows of it, so it asks `matrices` for the whole (optim/matrices.py)."""

  def __init__(self, groups, matrices, lr, beta):
    super().__init__(groups, dict(lr=lr, beta=beta))
    self.matrices = matrices

  @torch.no_grad()
  def step(self, closure=None):  # pylint: disable=unused-argument
    for group in self.param_groups:
      for name, p in zip(group['param_names'], group['params']):
        if p.grad is None:
          continue
        m = self.state[p].setdefault('momentum_buffer', torch.zeros_like(p))
        m.lerp_(p.grad.to(p.dtype), 1 - group['beta'])
        norm = self.matrices.whole(name, m).norm().clamp(min=1e-12)
        p.mul_(1 - group['lr'] * group['weight_decay']).add_(m / norm, alpha=-group['lr'])


def _build(params, optim_cfg, matrices, chunk_bytes):  # pylint: disable=unused-argument
  return NormalizedSGD(optimizers.param_groups(params, optim_cfg), matrices, float(optim_cfg.lr),
                       float(optim_cfg.betas[0]))


def register():
  """The recipe's one line (here guarded: spawned ranks import this module afresh)."""
  if 'normalized_sgd' not in optimizers.ENTRIES:
    optimizers.register('normalized_sgd', optimizers.Entry(_build, states=1))


@pytest.fixture
def registered(monkeypatch):
  """The optimizer registered in this process for the test only (the suite's other tests list
  the built-in names)."""
  monkeypatch.setattr(optimizers, 'ENTRIES', dict(optimizers.ENTRIES))
  register()


def test_a_registered_optimizer_steps_as_written_on_one_device(registered):  # pylint: disable=unused-argument,redefined-outer-name
  g = torch.Generator().manual_seed(0)
  p0 = torch.randn(6, 4, generator=g)
  p = p0.clone().requires_grad_()
  cfg = parity.parity_config(optim='normalized_sgd').model.optim
  cfg.lr, cfg.weight_decay = 0.1, 0.01
  opt = optimizers.make_optimizer({'layers.0.mlp.up_proj.weight': p}, cfg)
  want, m = p0.clone(), torch.zeros_like(p0)
  for _ in range(3):
    grad = torch.randn(p0.shape, generator=g)
    p.grad = grad
    opt.step()
    m = 0.9 * m + 0.1 * grad
    want = want * (1 - 0.1 * 0.01) - 0.1 * m / m.norm()
  parity.assert_close_roundoff(p.detach(), want, 3)
  assert optimizers.check(cfg) == []


def _train_layouts(workdirs, layouts):
  register()
  return parity.train_layouts_on_rank(workdirs, layouts)


def test_a_registered_optimizer_trains_like_one_device_under_zero1_and_tp(registered, tmp_path, tmp_path_factory):  # pylint: disable=unused-argument,redefined-outer-name
  layouts = {'dp2_zero1': {'zero1': True, 'optim': 'normalized_sgd'},
             'tp2_sp': {'tp': 2, 'sp': True, 'optim': 'normalized_sgd'}}
  per_rank = world.run(_train_layouts, 2, [str(tmp_path / n) for n in layouts], list(layouts.values()), timeout=480)
  for i, (name, layout) in enumerate(layouts.items()):
    parity.compare(name, layout, [rank[i] for rank in per_rank], tmp_path_factory)


# --- a new metric from inside the step ----------------------------------------------------------

def test_a_metric_returned_by_the_step_is_logged(tmp_path, monkeypatch):
  step = train.training.train_step

  def with_metric(*args, **kwargs):
    out = step(*args, **kwargs)
    out['grad_norm_sq'] = out['grad_norm'] ** 2      # the recipe's one line in train_step
    return out

  monkeypatch.setattr(train.training, 'train_step', with_metric)
  train.run(tiny_config(max_steps=4, val_check_interval=0), str(tmp_path))
  steps = [r for r in read_metrics(tmp_path) if 'loss' in r]
  assert len(steps) == 4
  for r in steps:
    assert r['grad_norm_sq'] == float(np.float32(r['grad_norm']) ** 2)   # one correctly rounded fp32 product


# --- a block feature that differs by layer -------------------------------------------------------

# transformer.LayerInputs with the recipe's new field: each layer's residual branch scale
ScaledLayer = collections.namedtuple('ScaledLayer', transformer.LayerInputs._fields + ('branch_scale',),
                                     defaults=tuple(transformer.LayerInputs._field_defaults.values()) + (1.0,))


SCALES = (0.5, 2.0, 1.0, 0.25)
# compiled graphs may sum in another order (parity.roundoff): the test preset's hidden 32, ffn 64
# and vocabulary 256, and a global batch of 8 x 16 tokens, carried through the steps' updates
LOSS_TERMS = 32 + 64 + 256 + 8 * 16


def _scaled_model(monkeypatch):
  """What the fork writes: the field set in stage (here: when the bundle is made) and read in
  the block (here: the block's change to the residual stream scaled)."""
  block = transformer.block
  monkeypatch.setattr(transformer, 'LayerInputs',
                      lambda *a: ScaledLayer(*a)._replace(branch_scale=SCALES[a[0]]))

  def scaled_block(params, layer, x_bsh, cfg, ops):
    return x_bsh + layer.branch_scale * (block(params, layer, x_bsh, cfg, ops) - x_bsh)

  monkeypatch.setattr(transformer, 'block', scaled_block)


def _losses(tmp_path, name, compile_blocks):
  c = tiny_config(max_steps=4, val_check_interval=0)
  c.model.num_layers = len(SCALES)
  c.model.compile, c.model.compile_backend = compile_blocks, 'aot_eager'
  train.run(c, str(tmp_path / name))
  return [r['loss'] for r in read_metrics(tmp_path / name) if 'loss' in r]


def test_a_per_layer_feature_in_the_block_inputs_compiles_like_eager(tmp_path, monkeypatch):
  plain = _losses(tmp_path, 'plain', False)
  _scaled_model(monkeypatch)
  try:
    eager, compiled = _losses(tmp_path, 'eager', False), _losses(tmp_path, 'compiled', True)
  finally:
    torch._dynamo.reset()     # pylint: disable=protected-access  # the fork's graphs leave with its block
  assert eager != plain                                  # the feature changes the model
  parity.assert_close_roundoff(torch.tensor(compiled), torch.tensor(eager), LOSS_TERMS)


# --- an attention variant ------------------------------------------------------------------------

@pytest.mark.parametrize('family', FAMILIES)
def test_every_attention_declares_its_layouts_and_describes_its_heads(family):
  """What a new attention's parameters must give the rest of the code: a declared TP layout for
  each (parallel/tensor.py, grads, checkpoints), and the start-up summary's heads per rank."""
  c = parity.parity_config(family=family, tp=2, sp=True)
  specs = param_table.param_specs(c.model, 2)
  assert all(spec.layout in param_table.LAYOUTS for spec in specs.values())
  lines = summary.describe_layout(c, meshes.Mesh(tp=2, dp=1, rank=0))
  assert len(lines) == 2 and all('heads' in line for line in lines), lines


# --- a data source -------------------------------------------------------------------------------

class Counting:
  """Token windows of one endless count: sample i is i*s, i*s + 1, ... (mod `modulus`)."""
  samples_per_epoch = None

  def __init__(self, modulus, seq_length):
    self.modulus, self.s = modulus, seq_length

  def samples(self, sample_ids):
    starts = np.asarray(sample_ids, np.int64)[:, None] * self.s
    return (starts + np.arange(self.s + 1)) % self.modulus


def test_a_registered_data_source_is_checked_and_feeds_the_loop_from_any_position(tmp_path, monkeypatch):
  monkeypatch.setattr(sources, 'REGISTRY', dict(sources.REGISTRY))
  sources.register('counting', lambda config, split: Counting(config.data.counting_modulus, config.data.seq_length),
                   needs={'data.counting_modulus': 'the token ids wrap here'})
  c = tiny_config(max_steps=4, val_check_interval=0)
  c.data.source, c.data.synthetic_vocab_size = 'counting', 0
  assert any('data.counting_modulus' in p for p in validate.check(c))       # needed, and unset
  with c.unlocked():
    c.data.counting_modulus = 32
  assert validate.check(c) == []
  batch = Loader(c, 'train').global_batch(8)[0]
  s = c.data.seq_length
  want = (np.arange(8, 8 + c.data.micro_batch_size)[:, None] * s + np.arange(s)) % 32
  np.testing.assert_array_equal(batch['tokens'].numpy(), want)
  train.run(c, str(tmp_path))
  losses = [r['loss'] for r in read_metrics(tmp_path) if 'loss' in r]
  assert len(losses) == 4 and losses[-1] < losses[0]      # a count is learnable
