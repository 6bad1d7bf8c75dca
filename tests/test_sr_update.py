"""bf16SR's one-pass update (optim/sr_update.py): compiled kernels equal the eager ones and the
reference pipeline (stochastic_rounding.stochastic_round_at; torch.optim.AdamW on fp32 copies) bit for bit
or within an fp32 ulp, on every layout."""
import logging

import numpy as np
import pytest
import torch

from numerics import stochastic_rounding
from optim import sr_kernels, sr_update
from parallel import grads as grad_ops
from tests import parity


def bits(t):
  return t.view(torch.int16)


def bits32(t):
  return t.view(torch.int32)


def full_box(shape):
  return tuple(slice(0, n) for n in shape)


def awkward_values(n, seed):
  """Normal values of many magnitudes, exact bf16 values, specials, near bf16 max, subnormals."""
  g = torch.Generator().manual_seed(seed)
  x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
  x[:8] = torch.tensor([0.0, -0.0, float('inf'), float('-inf'), float('nan'), 3.3e38, -3.39e38, 1e-40])
  x[8:16] = x[8:16].bfloat16().float()
  return x


@pytest.mark.parametrize('shape, box', [((40, 30), (slice(10, 30), slice(0, 30))),    # ZeRO-1 rows
                                        ((40, 30), (slice(0, 40), slice(7, 19))),      # TP columns
                                        ((5, 6, 7), (slice(1, 3), slice(2, 6), slice(0, 7))),
                                        ((1000,), (slice(3, 1000),))])
def test_round_at_is_stochastic_round_at_bit_for_bit(shape, box):
  sizes = tuple(s.stop - s.start for s in box)
  x = awkward_values(int(torch.tensor(sizes).prod()), 0).view(sizes)
  expected = stochastic_rounding.stochastic_round_at(x, box, shape, 3, 'sr', 1, 'w')
  got = sr_update.round_at(x, box, shape, 3, 'sr', 1, 'w')
  assert got.dtype == torch.bfloat16 and got.shape == x.shape
  assert torch.equal(bits(got), bits(expected))
  coalesced, layout = stochastic_rounding.index_layout(box, shape)
  assert len(coalesced) <= 2                                 # rows: one run; columns: two dims
  seed = torch.tensor(stochastic_rounding.key_seed(3, 'sr', 1, 'w'), dtype=torch.int32)
  eager = sr_update._round_kernel(x.reshape(coalesced), torch.tensor(layout), seed)
  assert torch.equal(bits(eager.view(x.shape)), bits(expected))
  assert sr_update.round_at(x[:0], (slice(0, 0),) + box[1:], shape, 0).shape == x[:0].shape


def _state(rows, seed):
  g = torch.Generator().manual_seed(seed)
  return {n: (torch.randn(r.shape, generator=g) * 1e-3, (torch.randn(r.shape, generator=g) * 1e-3).bfloat16(),
              (torch.rand(r.shape, generator=g) * 1e-6).bfloat16()) for n, r in rows.items()}


def _fused(rows, grads_and_moments, optimizer_cls, boxes, steps=2, scale=None, **kwargs):
  """`steps` fused steps on bf16 copies of `rows` (gradients times `scale` in the loop); returns
  rows and moments."""
  rows = {n: r.clone() for n, r in rows.items()}
  opt = optimizer_cls([{'params': [rows['w']], 'weight_decay': 0.1},
                       {'params': [rows['b']], 'weight_decay': 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kwargs)
  assert sr_update.fusable(opt, torch.device('cpu'))
  for step in range(steps):
    grads = {n: g * (step + 1) for n, (g, _, _) in grads_and_moments.items()}
    if step == 0:                                   # moments from a previous step, as a resume loads them
      for n, (_, m, v) in grads_and_moments.items():
        opt.state[rows[n]].update(step=torch.tensor(3.0), exp_avg=m.clone(), exp_avg_sq=v.clone())
    sr_update.adamw_step(opt, rows, grads, boxes, {n: (0, 'sr', step, n) for n in rows}, scale=scale)
  return {n: (r, opt.state[r]['exp_avg'], opt.state[r]['exp_avg_sq'], opt.state[r]['step']) for n, r in rows.items()}


def _reference(rows, grads_and_moments, optimizer_cls, boxes, steps=2, **kwargs):
  """The unfused pipeline: fp32 copies, torch's optimizer, stochastic_round_at with the same keys."""
  rows = {n: r.float().clone() for n, r in rows.items()}
  opt = optimizer_cls([{'params': [rows['w']], 'weight_decay': 0.1},
                       {'params': [rows['b']], 'weight_decay': 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                      foreach=False, **kwargs)
  for step in range(steps):
    for n, (g, m, v) in grads_and_moments.items():
      rows[n].grad = g * (step + 1)
      if step == 0:
        opt.state[rows[n]].update(step=torch.tensor(3.0), exp_avg=m.float(), exp_avg_sq=v.float())
    opt.step()
    with torch.no_grad():
      for n, r in rows.items():
        box, shape = boxes[n]
        r.copy_(stochastic_rounding.stochastic_round_at(r, box, shape, 0, 'sr', step, n).float())
        for k in ('exp_avg', 'exp_avg_sq'):
          opt.state[r][k] = stochastic_rounding.stochastic_round_at(opt.state[r][k], box, shape, 0, 'sr', step, n, k).float()
  return {n: (r.bfloat16(), opt.state[r]['exp_avg'].bfloat16(), opt.state[r]['exp_avg_sq'].bfloat16(),
              opt.state[r]['step']) for n, r in rows.items()}


ROWS = {'w': torch.randn(64, 48).bfloat16(), 'b': torch.randn(48).bfloat16()}
BOXES = {'w': (full_box((64, 48)), (64, 48)), 'b': (full_box((48,)), (48,))}


@pytest.mark.parametrize('optimizer_cls', [torch.optim.AdamW, torch.optim.Adam])
def test_fused_step_is_torchs_step_then_stochastic_round_at(optimizer_cls):
  moments = _state(ROWS, 1)
  got = _fused(ROWS, moments, optimizer_cls, BOXES)
  want = _reference(ROWS, moments, optimizer_cls, BOXES)
  for n in ROWS:
    for g, w in zip(got[n][:3], want[n][:3]):
      assert g.dtype == torch.bfloat16
      same = bits(g) == bits(w)
      # torch's vectorized lerp may fuse a multiply-add: an fp32 ulp apart before rounding, which
      # moves a stochastic rounding only where the noise sits at that ulp (p ~ 2^-16 each).
      assert same.float().mean() > 0.999, n
      assert torch.allclose(g[~same].float(), w[~same].float(), rtol=2**-7, atol=0)
    assert got[n][3].item() == want[n][3].item() == 5.0


def test_compiled_fused_step_is_the_eager_kernel_bit_for_bit(monkeypatch):
  moments = _state(ROWS, 2)
  compiled = _fused(ROWS, moments, torch.optim.AdamW, BOXES)
  monkeypatch.setattr(sr_update, '_compiled', lambda kernel: kernel)
  eager = _fused(ROWS, moments, torch.optim.AdamW, BOXES)
  for n in ROWS:
    for c, e in zip(compiled[n][:3], eager[n][:3]):
      assert torch.equal(bits(c), bits(e))


def test_bf16_gradients_scaled_in_the_loop_are_the_clipped_fp32_gradients_bit_for_bit(monkeypatch):
  """Updater.step hands the fused step the bf16 gradient buckets and the clip coefficient; the
  unfused path widens them and scales in place (grads.clip): the same fp32 multiply."""
  moments = _state(ROWS, 5)
  bf16 = {n: (g.bfloat16(), m, v) for n, (g, m, v) in moments.items()}
  scale = torch.tensor(0.3711)
  clipped = {}
  for n, (g, m, v) in bf16.items():
    widened = g.float()
    torch._foreach_mul_([widened], scale)
    clipped[n] = (widened, m, v)
  want = _fused(ROWS, clipped, torch.optim.AdamW, BOXES, steps=1)
  got = _fused(ROWS, bf16, torch.optim.AdamW, BOXES, steps=1, scale=scale)
  unscaled = _fused(ROWS, clipped, torch.optim.AdamW, BOXES, steps=1, scale=torch.tensor(1.0))
  monkeypatch.setattr(sr_update, '_compiled', lambda kernel: kernel)
  eager = _fused(ROWS, bf16, torch.optim.AdamW, BOXES, steps=1, scale=scale)
  for n in ROWS:
    for g, w, u, e in zip(got[n][:3], want[n][:3], unscaled[n][:3], eager[n][:3]):
      assert torch.equal(bits(g), bits(w)) and torch.equal(bits(u), bits(w)) and torch.equal(bits(e), bits(w))


def test_fused_step_rounds_alike_on_every_layout():
  moments = _state(ROWS, 3)
  whole = _fused(ROWS, moments, torch.optim.AdamW, BOXES, steps=1)
  for box in [(slice(0, 40), slice(0, 48)), (slice(40, 64), slice(0, 48)),      # ZeRO-1 rows
              (slice(0, 64), slice(0, 16)), (slice(8, 24), slice(16, 48))]:     # TP columns, both
    rows = {'w': ROWS['w'][box].clone(), 'b': ROWS['b'][box[1]].clone()}
    part = {'w': tuple(t[box] for t in moments['w']), 'b': tuple(t[box[1]] for t in moments['b'])}
    got = _fused(rows, part, torch.optim.AdamW, {'w': (box, (64, 48)), 'b': ((box[1],), (48,))}, steps=1)
    for g, w in zip(got['w'][:3], whole['w'][:3]):
      assert torch.equal(bits(g), bits(w[box]))
    for g, w in zip(got['b'][:3], whole['b'][:3]):
      assert torch.equal(bits(g), bits(w[box[1]]))


def _fp32_steps(rows, grads, optimizer_cls, fused, steps=3, scale=None):
  """`steps` Adam(W) steps on fp32 copies of `rows`: the one pass (gradients times `scale` in the
  loop), or torch's single-tensor step (gradients scaled first, as grads.clip does)."""
  rows = {n: r.float().clone() for n, r in rows.items()}
  opt = optimizer_cls([{'params': [rows['w']], 'weight_decay': 0.1},
                       {'params': [rows['b']], 'weight_decay': 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                      foreach=False)
  for step in range(steps):
    step_grads = {n: g * (step + 1) for n, g in grads.items()}
    if fused:
      sr_update.adamw_step(opt, rows, step_grads, scale=scale)
      continue
    if scale is not None:
      torch._foreach_mul_(list(step_grads.values()), scale)
    for n, r in rows.items():
      r.grad = step_grads[n]
    opt.step()
  return {n: (r, opt.state[r]['exp_avg'], opt.state[r]['exp_avg_sq'], opt.state[r]['step']) for n, r in rows.items()}


def _fp32_rows(seed, box=(slice(None), slice(None))):
  g = torch.Generator().manual_seed(seed)
  rows = {'w': torch.randn(64, 48, generator=g), 'b': torch.randn(48, generator=g)}
  grads = {n: torch.randn(r.shape, generator=g) * 1e-2 for n, r in rows.items()}
  return rows, grads


@pytest.mark.parametrize('optimizer_cls', [torch.optim.AdamW, torch.optim.Adam])
def test_fp32_fused_step_is_torchs_step_to_fp32_rounding(optimizer_cls):
  rows, grads = _fp32_rows(10)
  scale = torch.tensor(0.6173)
  got = _fp32_steps(rows, grads, optimizer_cls, True, scale=scale)
  want = _fp32_steps(rows, grads, optimizer_cls, False, scale=scale)
  for n in rows:
    assert all(t.dtype == torch.float32 for t in got[n][:3]) and got[n][3].item() == want[n][3].item() == 3.0
    # torch's vectorized lerp_, addcmul_ and addcdiv_ contract into fmas: an ulp or two of each
    # moment (more where Adam's L2 term cancels the gradient) and of the largest parameter
    for g, w in zip(got[n][:3], want[n][:3]):
      torch.testing.assert_close(g, w, rtol=4e-6, atol=4 * torch.finfo(torch.float32).eps * float(w.abs().max()), msg=n)


def test_fp32_fused_step_is_the_same_bits_on_every_layout_and_compiled_or_not(monkeypatch):
  rows, grads = _fp32_rows(11)
  whole = _fp32_steps(rows, grads, torch.optim.AdamW, True)
  for box in [(slice(0, 40), slice(0, 48)), (slice(40, 64), slice(0, 48)), (slice(8, 24), slice(16, 48))]:
    part = _fp32_steps({'w': rows['w'][box], 'b': rows['b'][box[1]]},
                       {'w': grads['w'][box], 'b': grads['b'][box[1]]}, torch.optim.AdamW, True)
    for g, w in zip(part['w'][:3], whole['w'][:3]):
      assert torch.equal(bits32(g), bits32(w[box]))
    for g, w in zip(part['b'][:3], whole['b'][:3]):
      assert torch.equal(bits32(g), bits32(w[box[1]]))
  monkeypatch.setattr(sr_update, '_compiled', lambda kernel: kernel)
  eager = _fp32_steps(rows, grads, torch.optim.AdamW, True)
  for n in rows:
    for e, w in zip(eager[n][:3], whole[n][:3]):
      assert torch.equal(bits32(e), bits32(w))


def test_fused_step_creates_torchs_state_on_a_first_step():
  rows = {'w': ROWS['w'].clone(), 'b': ROWS['b'].clone()}
  opt = torch.optim.AdamW([rows['w'], rows['b']], lr=1e-3)
  sr_update.adamw_step(opt, rows, {'w': torch.ones(64, 48), 'b': None}, BOXES, {n: (0, n) for n in rows})
  state = opt.state[rows['w']]
  assert sorted(state) == ['exp_avg', 'exp_avg_sq', 'step'] and state['step'].item() == 1.0
  assert state['exp_avg'].dtype == torch.bfloat16 and state['exp_avg'].shape == (64, 48)
  assert rows['b'] not in opt.state                           # no gradient: not stepped


def test_only_plain_adam_and_adamw_on_a_compiled_device_are_fused():
  p = [torch.zeros(2, requires_grad=True)]
  assert not sr_update.fusable(torch.optim.AdamW(p, amsgrad=True), torch.device('cpu'))
  assert not sr_update.fusable(torch.optim.SGD(p, lr=1.0), torch.device('cpu'))
  assert not sr_update.fusable(torch.optim.AdamW(p), torch.device('meta'))
  # flatron's CUDA optimizers are built fused=True: the one pass replaces torch's kernel there too
  assert sr_update.fusable(torch.optim.AdamW(p, fused=True), torch.device('cpu'))
  # fp32 rows: on the CPU only (CUDA's fused AdamW is one multi-tensor kernel already)
  assert sr_update.fusable(torch.optim.AdamW(p), torch.device('cpu'), torch.float32)
  assert not sr_update.fusable(torch.optim.AdamW(p, fused=True), torch.device('cuda'), torch.float32)
  assert sr_update.fusable(torch.optim.AdamW(p, fused=True), torch.device('cuda'))


def test_a_failed_compile_falls_back_to_the_eager_kernel(monkeypatch, caplog):
  def broken(kernel):
    def fail(*args):
      raise RuntimeError('no C++ compiler')
    return fail
  monkeypatch.setattr(sr_update, '_compiled', broken)
  monkeypatch.setattr(sr_update, '_failed', set())
  x = awkward_values(300, 4).view(10, 30)
  with caplog.at_level(logging.WARNING):
    got = sr_update.round_at(x, full_box((10, 30)), (10, 30), 1)
  assert 'running it eagerly' in caplog.text
  assert torch.equal(bits(got).view(10, 30), bits(stochastic_rounding.stochastic_round_at(x, full_box((10, 30)), (10, 30), 1)))


def test_square_sum_is_the_eager_norms_sum_to_rounding_and_eager_where_not_compiled():
  g = torch.Generator().manual_seed(6)
  # >= FUSED_FP32_MIN_NUMEL: compiled. Integers of magnitude <= 8: every square and partial sum
  # (< 2**24) is exact in fp32, so the sum is float64's in any order (a vector width's, a thread count's)
  large = torch.randint(-8, 9, (300, 700), generator=g).bfloat16()
  for t in (large, large.float()):
    got = sr_update.square_sum(t)
    assert got.dtype == torch.float32 and got.shape == () and got.item() == t.double().pow(2).sum().item()
  eager = [torch.randn(300, 70, generator=g).bfloat16(), torch.randn(300, 70, generator=g),  # small: eager's bits
           torch.zeros(0)]
  for t in eager:
    got = sr_update.square_sum(t)
    assert got.dtype == torch.float32 and got.shape == ()
    # the fp32 round-off of a numel-term sum (parity.roundoff; each square rounds once at most)
    torch.testing.assert_close(got, t.double().pow(2).sum().float(), rtol=parity.roundoff(t.numel(), slack=1), atol=0)
  for t in eager:
    assert torch.equal(sr_update.square_sum(t), grad_ops.square_sum(t))


def test_the_probe_finds_compiled_equal_to_eager_on_the_cpu():
  assert sr_update.differing_bits(sr_update._round_kernel, torch.device('cpu')) == (0, 1 << 22)
  assert sr_update.differing_bits(sr_update._adamw_kernel, torch.device('cpu')) == (0, 3 << 22)
  assert sr_update.differing_bits(sr_update._adamw_fp32_kernel, torch.device('cpu')) == (0, 3 << 22)
  assert sr_update.differing_bits(sr_update._adamw_master_kernel, torch.device('cpu')) == (0, 4 << 22)


def test_eager_sqrt_is_correctly_rounded_as_compiled_kernels_sqrt_is():
  # eager's CPU sqrt alone is an ulp off for about 1 value in 5 (why _sqrt goes through fp64)
  g = torch.Generator().manual_seed(8)
  x = torch.rand(1 << 20, generator=g) * torch.exp2(torch.randint(-120, 120, (1 << 20,), generator=g).float())
  exact = torch.from_numpy(np.sqrt(x.numpy()))            # IEEE sqrt, correctly rounded
  assert torch.equal(bits32(sr_kernels._sqrt(x)), bits32(exact))


def test_the_probe_sees_a_kernel_that_contracts_or_divides_differently(monkeypatch):
  # what triton's fma or approximate division would do: an fp32 ulp before the rounding
  def nudged(kernel):
    return lambda x, layout, seed: sr_kernels._round(torch.nextafter(x.float(), torch.tensor(float('inf'))),
                                                    stochastic_rounding.index_from_layout(x.shape, layout), seed)
  monkeypatch.setattr(sr_update, '_compiled', nudged)
  assert sr_update.differing_bits(sr_update._round_kernel, torch.device('cpu'))[0] > 0


def test_a_device_whose_compiled_bits_differ_runs_the_eager_kernel(monkeypatch, caplog):
  monkeypatch.setattr(sr_update, 'differing_bits', lambda kernel, device: (7, 1000))
  monkeypatch.setattr(sr_update, '_failed', set())
  monkeypatch.setattr(sr_update, '_checks', {})
  monkeypatch.setattr(sr_update, '_compiled', lambda kernel: pytest.fail('compiled kernel used'))
  x = awkward_values(300, 5).view(10, 30)
  sizes, layout = sr_update._layout(full_box((10, 30)), (10, 30), x.device)
  seed = sr_update._seed((1,), x.device)
  with caplog.at_level(logging.WARNING):
    # a CUDA device object needs no GPU: only its type is read before the eager kernel runs here
    got = sr_update._run(sr_update._round_kernel, torch.device('cuda'), x.reshape(sizes), layout, seed)
  assert 'rounds 7 of its probe\'s 1000 bf16 outputs differently' in caplog.text
  assert 'running it eagerly' in caplog.text
  assert torch.equal(bits(got).view(10, 30), bits(stochastic_rounding.stochastic_round_at(x, full_box((10, 30)), (10, 30), 1)))
