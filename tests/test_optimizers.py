"""Optimizers by name: they build, descend, group weight decay, and match hand-written updates."""
import pytest
import torch

from configs import base
from optim import optimizers

SHAPES = {
    'embed_tokens.weight': (8, 4),
    'embed_positions.weight': (6, 4),
    'layers.0.input_layernorm.weight': (4,),
    'layers.0.self_attn.q_proj.weight': (4, 4),
    'layers.0.self_attn.q_proj.bias': (4,),
    'layers.0.post_attention_layernorm.weight': (4,),
    'norm.weight': (4,),
    'norm.bias': (4,),
    'lm_head.weight': (8, 4),
}
DECAYED = ['embed_tokens.weight', 'embed_positions.weight', 'layers.0.self_attn.q_proj.weight', 'lm_head.weight']
EXEMPT = ['layers.0.input_layernorm.weight', 'layers.0.self_attn.q_proj.bias',
          'layers.0.post_attention_layernorm.weight', 'norm.weight', 'norm.bias']


def optim_cfg(**overrides):
  o = base.get_config().model.optim
  for key, value in overrides.items():
    o[key] = value
  return o


def tiny_params(seed=0):
  gen = torch.Generator().manual_seed(seed)
  return {n: torch.randn(shape, generator=gen).requires_grad_() for n, shape in SHAPES.items()}


def quadratic(params):
  return sum(((p - 0.5) ** 2).sum() for p in params.values())


def set_quadratic_grads(params):
  for p in params.values():
    p.grad = None
  quadratic(params).backward()


@pytest.mark.parametrize('name', optimizers.OPTIMIZERS)
def test_each_optimizer_builds_and_reduces_a_quadratic(name):
  params = tiny_params()
  opt = optimizers.make_optimizer(params, optim_cfg(name=name, lr=0.05, weight_decay=0.0))
  start = quadratic(params).item()
  for _ in range(5):
    set_quadratic_grads(params)
    opt.step()
  assert quadratic(params).item() < start


@pytest.mark.parametrize('name', optimizers.OPTIMIZERS)
@pytest.mark.parametrize('decay_norms', [False, True])
def test_weight_decay_groups(name, decay_norms):
  params = tiny_params()
  opt = optimizers.make_optimizer(params, optim_cfg(name=name, weight_decay=0.1, do_layer_norm_weight_decay=decay_norms))
  groups = [(g['param_names'], g.get('weight_decay')) for g in opt.param_groups]
  for group in opt.param_groups:
    assert all(p is params[n] for n, p in zip(group['param_names'], group['params']))
  takes_decay = name != 'rprop'
  if name == 'muon':      # each decay group in two: the layers' matrices (Muon's rule) and the rest (AdamW's)
    assert all(g['muon'] == all(n.startswith('layers.') and params[n].dim() == 2 for n in g['param_names'])
               for g in opt.param_groups)
    merged = {}
    for names, decay in groups:
      merged.setdefault(decay, set()).update(names)
    want = [(list(SHAPES), 0.1)] if decay_norms else [(DECAYED, 0.1), (EXEMPT, 0.0)]
    assert merged == {decay: set(names) for names, decay in want}
    return
  if decay_norms:
    assert groups == [(list(SHAPES), 0.1 if takes_decay else None)]
  else:
    assert groups == [(DECAYED, 0.1 if takes_decay else None), (EXEMPT, 0.0 if takes_decay else None)]


def test_decays_weight():
  assert all(optimizers.decays_weight(n) for n in DECAYED)
  assert not any(optimizers.decays_weight(n) for n in EXEMPT)
  assert not optimizers.decays_weight('layers.3.self_attn.q_norm.weight')
  assert not optimizers.decays_weight('layers.3.mlp.down_proj.bias')


def test_tied_tensor_is_optimized_once():
  params = tiny_params()
  params['lm_head.weight'] = params['embed_tokens.weight']
  opt = optimizers.make_optimizer(params, optim_cfg())
  assert opt.param_groups[0]['param_names'] == ['embed_tokens.weight', 'embed_positions.weight',
                                                'layers.0.self_attn.q_proj.weight']


def test_adamw_matches_hand_written_step():
  lr, (b1, b2), eps, wd = 0.01, (0.8, 0.9), 1e-6, 0.1
  params = tiny_params()
  before = {n: p.detach().clone() for n, p in params.items()}
  opt = optimizers.make_optimizer(params, optim_cfg(name='adamw', lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd))
  set_quadratic_grads(params)
  opt.step()
  for n, p in params.items():
    g, p0 = 2 * (before[n] - 0.5), before[n]
    m_hat = (1 - b1) * g / (1 - b1)
    v_hat = (1 - b2) * g * g / (1 - b2)
    decay = wd if n in DECAYED else 0.0
    expected = p0 * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_novograd_matches_hand_written_reference_for_three_steps():
  lr, (b1, b2), eps, wd = 0.05, (0.9, 0.5), 1e-8, 0.1
  params = tiny_params()
  ref = {n: p.detach().clone().double() for n, p in params.items()}
  opt = optimizers.make_optimizer(params, optim_cfg(name='novograd', lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd))
  moments = {n: (torch.zeros_like(p), None) for n, p in ref.items()}
  for _ in range(3):
    set_quadratic_grads(params)
    grads_before = {n: p.grad.clone() for n, p in params.items()}
    opt.step()
    for n, p in ref.items():
      g = 2 * (p - 0.5)
      m, v = moments[n]
      norm_sq = (g * g).sum()
      v = norm_sq if v is None else b2 * v + (1 - b2) * norm_sq  # one scalar per tensor
      m = b1 * m + g / (v.sqrt() + eps) + (wd if n in DECAYED else 0.0) * p
      ref[n] = p - lr * m
      moments[n] = (m, v)
    for n, p in params.items():
      torch.testing.assert_close(p.grad, grads_before[n], rtol=0, atol=0)  # grads left untouched
      torch.testing.assert_close(p.detach().double(), ref[n], rtol=1e-5, atol=1e-6)


def test_check_accepts_defaults_and_every_name():
  for name in optimizers.OPTIMIZERS:
    wd = 0.0 if name == 'rprop' else 0.01
    assert optimizers.check(optim_cfg(name=name, weight_decay=wd)) == [], name


def test_check_reports_bad_name_with_valid_ones():
  problems = optimizers.check(optim_cfg(name='adamx'))
  assert problems == ["model.optim.name='adamx' is unknown; valid: " + ', '.join(optimizers.OPTIMIZERS)]
  with pytest.raises(ValueError, match='adamx'):
    optimizers.make_optimizer(tiny_params(), optim_cfg(name='adamx'))


@pytest.mark.parametrize('key, value', [
    ('lr', 0.0), ('lr', -1e-3), ('betas', (0.9, 1.0)), ('betas', (-0.1, 0.9)), ('eps', 0.0),
    ('weight_decay', -0.01), ('momentum', -0.5)])
def test_check_reports_bad_values_by_key(key, value):
  problems = optimizers.check(optim_cfg(**{key: value}))
  assert len(problems) == 1 and problems[0].startswith(f'model.optim.{key}='), problems


def test_check_reports_weight_decay_rprop_would_ignore():
  problems = optimizers.check(optim_cfg(name='rprop', weight_decay=0.01))
  assert len(problems) == 1 and 'model.optim.weight_decay=' in problems[0]


def test_chunks_bound_bytes_and_keep_order():
  sizes = [10, 10, 30, 5, 100, 1]
  runs = optimizers.chunks(sizes, chunk_bytes=4 * 25)
  assert runs == [[0, 1], [2], [3], [4], [5]]              # 30 and 100 elements alone: over the bound
  assert [i for run in runs for i in run] == list(range(len(sizes)))


@pytest.mark.parametrize('name', ['adamw', 'adam', 'sgd', 'novograd'])
def test_chunked_steps_are_bitwise_equal(name):
  whole, chunked = tiny_params(), tiny_params()
  cfg = optim_cfg(name=name, lr=0.05, weight_decay=0.1, momentum=0.9)
  opt_whole = optimizers.make_optimizer(whole, cfg, chunk_bytes=2**40)
  opt_chunked = optimizers.make_optimizer(chunked, cfg, chunk_bytes=1)       # one tensor per group
  assert len(opt_chunked.param_groups) > len(opt_whole.param_groups)
  for _ in range(3):
    for params, opt in ((whole, opt_whole), (chunked, opt_chunked)):
      set_quadratic_grads(params)
      opt.step()
  for n, p in whole.items():
    assert torch.equal(p, chunked[n]), n


def test_a_registered_optimizer_is_built_checked_and_counted(monkeypatch):
  monkeypatch.setattr(optimizers, 'ENTRIES', dict(optimizers.ENTRIES))
  seen = []

  def build(params, optim_cfg, matrices, chunk_bytes):
    seen.append((sorted(params), matrices.matrix_shape('lm_head.weight'), chunk_bytes))
    return torch.optim.SGD(optimizers.param_groups(params, optim_cfg), lr=optim_cfg.lr)

  optimizers.register('plain_sgd', optimizers.Entry(build, states=0, check=lambda o: ['own problem']))
  params = tiny_params()
  assert isinstance(optimizers.make_optimizer(params, optim_cfg(name='plain_sgd'), chunk_bytes=64), torch.optim.SGD)
  assert seen == [(sorted(params), (8, 4), 64)]
  assert optimizers.check(optim_cfg(name='plain_sgd')) == ['own problem']
  assert optimizers.state_count('plain_sgd', 'lm_head.weight', 2) == 0
  assert 'plain_sgd' in optimizers.check(optim_cfg(name='nope'))[0]
  with pytest.raises(ValueError, match="'adamw' is registered already"):
    optimizers.register('adamw', optimizers.Entry(build))
