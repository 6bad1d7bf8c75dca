"""optim/muon.py: Muon's hidden matrices step exactly as torch.optim.Muon (everything else as
torch's AdamW), Lion as the paper's rule written out; both train like one device at tp2 + SP,
pp2, dp2 + ZeRO-1, ZeRO-3 and ep2 (each expert its own matrix), resume bitwise, and a Muon
checkpoint saved at dp2 + ZeRO-1 continues at tp2 + SP."""
import numpy as np
import pytest
import torch

from configs import base, validate
from optim import muon, optimizers
from tests import parity, world
from tests.test_session import _resume_from, _run, losses

MATRIX, NORM, EMBED = 'layers.0.self_attn.q_proj.weight', 'layers.0.input_layernorm.weight', 'embed_tokens.weight'


def _optim_cfg(name, **muon_keys):
  cfg = base.get_config().model.optim
  cfg.name, cfg.lr, cfg.weight_decay = name, 0.02, 0.1
  cfg.muon.update(muon_keys)
  return cfg


def _params(seed=0):
  g = torch.Generator().manual_seed(seed)
  return {MATRIX: torch.randn(12, 8, generator=g), NORM: torch.randn(8, generator=g), EMBED: torch.randn(16, 8, generator=g)}


def _steps(optimizer, params, steps=3, seed=1):
  g = torch.Generator().manual_seed(seed)
  for _ in range(steps):
    for p in params:
      p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()


def test_muon_steps_the_matrices_as_torch_muon_and_the_rest_as_adamw():
  ours = {n: p.clone().requires_grad_() for n, p in _params().items()}
  theirs = {n: p.clone().requires_grad_() for n, p in _params().items()}
  cfg = _optim_cfg('muon')
  _steps(optimizers.make_optimizer(ours, cfg), list(ours.values()))
  reference = [torch.optim.Muon([theirs[MATRIX]], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                adjust_lr_fn='match_rms_adamw'),
               torch.optim.AdamW([{'params': [theirs[EMBED]], 'weight_decay': 0.1},     # norms are not decayed
                                  {'params': [theirs[NORM]], 'weight_decay': 0.0}], lr=0.02, betas=(0.9, 0.95))]

  class Both:
    def step(self):
      for r in reference:
        r.step()
  _steps(Both(), list(theirs.values()))
  # the matrix: torch's own ops in its order, so bit for bit; AdamW's rows: torch may fuse or
  # reorder its arithmetic, so within fp32's round-off of 3 steps
  torch.testing.assert_close(ours[MATRIX], theirs[MATRIX], rtol=0, atol=0)
  for name in (NORM, EMBED):
    parity.assert_close_roundoff(ours[name].detach(), theirs[name].detach(), 3, msg=lambda m, n=name: f'{n}: {m}')


def test_the_iteration_orthogonalizes_each_expert_on_its_own():
  g = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(2))
  stacked = muon.newton_schulz(g, 5, torch.float32)
  for e in range(3):
    torch.testing.assert_close(stacked[e], muon.newton_schulz(g[e], 5, torch.float32))
  # the iteration's fixed point: singular values near 1 (torch's quintic spreads them over ~0.7-1.2)
  assert torch.linalg.svdvals(stacked[0]).min() > 0.6 and torch.linalg.svdvals(stacked[0]).max() < 1.3


def test_lion_is_the_papers_rule():
  p0 = _params()[MATRIX]
  p = p0.clone().requires_grad_()
  _steps(optimizers.make_optimizer({MATRIX: p}, _optim_cfg('lion')), [p])
  g, want, m = torch.Generator().manual_seed(1), p0.clone(), torch.zeros_like(p0)
  (b1, b2), lr, wd = (0.9, 0.95), 0.02, 0.1
  for _ in range(3):
    grad = torch.randn(p0.shape, generator=g)
    want = want * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * grad)
    m = b2 * m + (1 - b2) * grad
  parity.assert_close_roundoff(p.detach(), want, 3)      # 3 steps' round-off, summed in another order


def test_bad_settings_are_refused_by_name():
  c = parity.parity_config(optim='muon')
  c.model.optim.muon.update(momentum=1.0, ns_steps=0, ns_dtype='fp8', adjust_lr='none')
  problems = '\n'.join(validate.check(c))
  for needed in ('model.optim.muon.momentum=1.0 must be in [0, 1)', 'model.optim.muon.ns_steps=0 must be >= 1',
                 "model.optim.muon.ns_dtype='fp8'; valid: bfloat16, float32",
                 "model.optim.muon.adjust_lr='none'; valid: match_rms_adamw, original"):
    assert needed in problems, needed


LAYOUTS = {f'{name}_{optim}': (size, dict(layout, optim=optim))
           for optim in ('muon', 'lion')
           for name, (size, layout) in {'tp2_sp': (2, {'tp': 2, 'sp': True}), 'pp2': (2, {'pp': 2}),
                                        'dp2_zero1': (2, {'zero1': True}),
                                        'dp2_zero3': (2, {'zero1': True, 'zero_stage': 3}),
                                        'ep2': (2, {'moe': 4, 'ep': 2}),
                                        'ep2_tp2_sp': (4, {'moe': 4, 'ep': 2, 'tp': 2, 'sp': True})}.items()}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_every_layout_trains_like_one_device(world_size, tmp_path, tmp_path_factory):
  parity.check_layouts(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


def test_muon_resumes_bitwise_and_at_another_layout(tmp_path):
  layout = {'zero1': True, 'optim': 'muon'}
  first = world.run(world.in_turn, 2, [(_run, (str(tmp_path / 'straight'), layout, 0)),
                                       (_run, (str(tmp_path / 'saved'), layout, 10))])
  resumed = world.run(_run, 2, str(tmp_path / 'saved'), layout, 0)
  assert losses(tmp_path / 'saved') == losses(tmp_path / 'straight')      # identical floats
  a, b = (parity.assemble(r, parity.parity_config().model) for r in ([r[0] for r in first], resumed))
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  saved = str(tmp_path / 'saved' / 'checkpoints' / 'step_00000010')
  world.run(_resume_from, 2, str(tmp_path / 'tp2'), {'tp': 2, 'sp': True, 'optim': 'muon'}, saved)
  np.testing.assert_allclose(losses(tmp_path / 'tp2'), losses(tmp_path / 'straight')[10:], rtol=1e-5)


@pytest.mark.parametrize('precision', ['bf16SR', 'mixed_precision'])
def test_muon_and_lion_train_under_the_16_bit_recipes(precision, tmp_path):
  """bf16SR widens the bf16 rows and their momentum for the step and rounds them back; mixed
  precision steps fp32 masters: each run's loss falls."""
  import train  # pylint: disable=import-outside-toplevel
  from tests.test_train import read_metrics, tiny_config  # pylint: disable=import-outside-toplevel
  for optim in ('muon', 'lion'):
    c = tiny_config(max_steps=10, val_check_interval=0)
    c.precision.type, c.model.optim.name = precision, optim
    c.model.optim.lr = 3e-3 if optim == 'lion' else 1e-2
    train.run(c, str(tmp_path / optim))
    losses = [r['loss'] for r in read_metrics(tmp_path / optim) if 'loss' in r]
    assert losses[-1] < losses[0] - 0.3, (optim, losses)


def test_a_bf16_iteration_on_the_cpu_is_warned_about():
  c = parity.parity_config(optim='muon')
  c.device = 'cpu'
  assert not any('ns_dtype' in w for w in validate.warnings(c))           # parity's: float32
  c.model.optim.muon.ns_dtype = 'bfloat16'
  assert any(w.startswith('model.optim.muon.ns_dtype=bfloat16 on the CPU') for w in validate.warnings(c))
