"""Stochastic rounding fp32 -> bf16 (numerics/stochastic_rounding.py; the recipes: tests/test_precision.py):
always a bf16 neighbour, unbiased, keyed; exact values and specials pass, no overflow past bf16 max; the
keyed noise (lowbias32 of the global index) is uniform and rounds a box alike on every layout."""
import math

import pytest
import torch

from numerics import stochastic_rounding
from numerics.stochastic_rounding import (add_stochastic, keyed_noise, stochastic_round,
                                          stochastic_round_at, stochastic_round_keyed)
import rng

BF16_ULP_AT_ONE = 2.0**-7            # 7 stored mantissa bits: the spacing of bf16 in [1, 2)


def bf16_bits(x_bf16):
  return x_bf16.view(torch.int16).to(torch.int32) & 0xFFFF


def bf16_neighbours(x):
  """(toward zero, away from zero): the bf16 values bracketing fp32 x, from bit patterns.

  Truncating the low 16 bits of a sign-magnitude pattern rounds toward zero; adding one
  to the bf16 pattern steps to the next value away from zero (nextafter), for either sign.
  """
  high = (x.view(torch.int32) >> 16) & 0xFFFF                     # unsigned 16-bit pattern

  def as_bf16(pattern):
    signed = torch.where(pattern >= 1 << 15, pattern - (1 << 16), pattern)
    return signed.to(torch.int16).view(torch.bfloat16)
  return as_bf16(high), as_bf16(high + 1)


def random_fp32(n, seed):
  """Uniformly random bit patterns: every magnitude, both signs, subnormals, inf, nan."""
  g = torch.Generator().manual_seed(seed)
  bits = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
  return bits.view(torch.float32)


def test_result_is_always_a_bf16_neighbour():
  g = torch.Generator().manual_seed(0)
  subnormal_bits = torch.randint(1, 1 << 23, (2000,), generator=g, dtype=torch.int32)
  x = torch.cat([random_fp32(20000, 1), subnormal_bits.view(torch.float32),
                 -subnormal_bits.view(torch.float32), torch.tensor([0.0, -0.0, 1e-45, -1e-45])])
  x = x[torch.isfinite(x)]
  down, up = bf16_neighbours(x)
  assert (down.double().abs() <= x.double().abs()).all()            # the helper brackets x
  assert (x.double().abs() <= up.double().abs()).all()
  went_up = torch.zeros(len(x), dtype=torch.bool)
  for draw in range(8):
    r = stochastic_round_keyed(x, 0, 'neighbours', draw)
    is_down, is_up = bf16_bits(r) == bf16_bits(down), bf16_bits(r) == bf16_bits(up)
    assert (is_down | is_up).all()
    went_up |= is_up
  exact = (x.view(torch.int32) & 0xFFFF) == 0
  assert torch.equal(stochastic_round_keyed(x[exact], 0, 'exact').float(), x[exact])
  assert not went_up[exact].any()
  assert went_up[~exact].float().mean() > 0.5                        # not a plain truncation


def test_exact_bf16_values_and_specials_pass_through():
  specials = torch.tensor([0.0, -0.0, 1.0, -2.5, float('inf'), float('-inf'), float('nan')])
  bf16_values = random_fp32(5000, 2).bfloat16()
  x = torch.cat([specials, bf16_values.float()])
  r = stochastic_round_keyed(x, 0, 'specials')
  assert torch.equal(bf16_bits(r[~x.isnan()]), bf16_bits(x[~x.isnan()].bfloat16()))
  assert r[x.isnan()].isnan().all()


def test_no_overflow_to_inf_near_bf16_max():
  bf16_max = torch.finfo(torch.bfloat16).max
  f32_max = torch.finfo(torch.float32).max
  below_max = torch.tensor([0x7F7E8000], dtype=torch.int32).view(torch.float32).item()
  above_max = torch.tensor([0x7F7F8000], dtype=torch.int32).view(torch.float32).item()
  x = torch.tensor([bf16_max, above_max, f32_max, below_max]).repeat(10000)
  x = torch.cat([x, -x])
  r = stochastic_round_keyed(x, 0, 'max').float()
  assert torch.isfinite(r).all()
  beyond = x.abs() > bf16_max                                        # saturate to +-bf16 max
  assert torch.equal(r[beyond], torch.sign(x[beyond]) * bf16_max)
  halfway = x.abs() == below_max                                     # can still round up to max
  below_neighbour = torch.tensor([0x7F7E0000], dtype=torch.int32).view(torch.float32).item()
  assert set(r[halfway].abs().unique().tolist()) == {below_neighbour, bf16_max}
  assert torch.isinf(stochastic_round_keyed(torch.tensor([float('inf')]), 0, 'x')).all()


def test_explicit_noise_sets_the_direction():
  x = torch.tensor([1.0 + 2**-10, -(1.0 + 2**-10), 3.0])
  down, up = bf16_neighbours(x)
  zeros, full = torch.zeros(3, dtype=torch.int32), torch.full((3,), 0xFFFF, dtype=torch.int32)
  assert torch.equal(stochastic_round(x, zeros), down)
  assert torch.equal(stochastic_round(x, full)[:2], up[:2])
  assert stochastic_round(x, full)[2] == 3.0                         # exact values never move
  with pytest.raises(ValueError, match='noise'):
    stochastic_round(x, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize('x', [1.0 + 0.3 * BF16_ULP_AT_ONE, -(1.0 + 0.9 * BF16_ULP_AT_ONE),
                               3.14159, -2.7e-3, 1e-3 * 2**-126, 12345.678])
def test_unbiased_in_expectation(x):
  n = 200_000
  xs = torch.full((n,), x)
  x = xs[0].double().item()                                          # the fp32 value rounded
  down, up = (v[0].double().item() for v in bf16_neighbours(xs[:1]))
  p_up = (x - down) / (up - down)
  # Each draw is down + (up - down) * Bernoulli(p_up): the mean's standard error follows.
  standard_error = abs(up - down) * math.sqrt(p_up * (1 - p_up) / n)
  mean = stochastic_round_keyed(xs, 0, 'unbiased', x).double().mean().item()
  assert abs(mean - x) < 5 * standard_error
  nearest_error = abs(xs[:1].bfloat16().double().item() - x)
  assert nearest_error > 20 * standard_error                         # RTN is biased; SR is not


def test_same_key_same_bits_and_different_keys_differ():
  x = torch.randn(4096) * 10
  a = stochastic_round_keyed(x, 7, 'sr', 3, 'w')
  assert torch.equal(bf16_bits(a), bf16_bits(stochastic_round_keyed(x, 7, 'sr', 3, 'w')))
  assert not torch.equal(a, stochastic_round_keyed(x, 7, 'sr', 4, 'w'))
  torch.manual_seed(0)                                               # the global RNG plays no part
  assert torch.equal(a, stochastic_round_keyed(x, 7, 'sr', 3, 'w'))


def test_small_updates_stall_under_round_to_nearest_but_not_under_sr():
  steps, seed = 1000, 1234
  update = torch.tensor(1e-4)
  assert update < BF16_ULP_AT_ONE / 2                                # below half an ulp at 1.0
  nearest = torch.ones((), dtype=torch.bfloat16)
  for _ in range(steps):
    nearest = (nearest.float() + update).bfloat16()
  assert nearest.item() == 1.0

  # The weight stays in [1, 2), where one step rounds up by an ulp with p = update / ulp:
  # per-step variance ulp^2 p (1 - p), independent across steps, mean exactly +update.
  p = update.item() / BF16_ULP_AT_ONE
  sd = math.sqrt(steps * BF16_ULP_AT_ONE**2 * p * (1 - p))
  expected = 1.0 + steps * update.item()
  w = torch.ones((), dtype=torch.bfloat16)
  many = torch.ones(4096, dtype=torch.bfloat16)                     # independent replicas
  for step in range(steps):
    w = add_stochastic(w, update, seed, step)
    many = add_stochastic(many, update.expand(4096), seed, 'replicas', step)
  assert w.dtype == torch.bfloat16
  assert abs(w.item() - expected) < 5 * sd
  assert abs(many.double().mean().item() - expected) < 5 * sd / math.sqrt(4096)


# --- layout-independent noise (keyed_noise, stochastic_round_at)

def full_box(shape):
  return tuple(slice(0, n) for n in shape)


def row_shards(rows, parts):
  """ZeRO-1's split: `parts` shards of ceil(rows / parts) rows, the last ones short or empty."""
  per = math.ceil(rows / parts)
  return [slice(min(i * per, rows), min((i + 1) * per, rows)) for i in range(parts)]


def column_shards(columns, parts):
  per = columns // parts
  return [slice(i * per, (i + 1) * per) for i in range(parts)]


def layouts():
  """(global shape, boxes): ZeRO-1 rows, TP columns, both, a 1-D and a 3-D tensor."""
  yield (10, 6), [(rows, slice(0, 6)) for rows in row_shards(10, 4)]        # 3, 3, 3, 1 rows
  yield (5, 6), [(rows, slice(None)) for rows in row_shards(5, 8)]          # empty shards too
  yield (8, 12), [(slice(0, 8), cols) for cols in column_shards(12, 4)]     # TP row-parallel
  yield (7, 12), [(rows, cols) for cols in column_shards(12, 2)            # TP x ZeRO-1
                  for rows in row_shards(7, 3)]
  yield (37,), [(rows,) for rows in row_shards(37, 4)]
  yield (4, 5, 6), [(slice(1, 3), slice(0, 5), slice(2, 6)),
                    (slice(0, 4), slice(4, 5), slice(0, 1)),
                    (slice(3, 4), slice(None), slice(None))]
  yield (), [()]


@pytest.mark.parametrize('shape, boxes', list(layouts()))
def test_noise_of_a_box_is_that_slice_of_the_full_noise(shape, boxes):
  full = keyed_noise(full_box(shape), shape, 3, 'sr', 11, 'w')
  assert full.shape == shape and full.dtype == torch.int32
  for box in boxes:
    assert torch.equal(keyed_noise(box, shape, 3, 'sr', 11, 'w'), full[box])


@pytest.mark.parametrize('shape, boxes', list(layouts()))
def test_every_layout_rounds_every_element_the_same_way(shape, boxes):
  x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 10
  whole = stochastic_round_at(x, full_box(shape), shape, 3, 'sr', 11, 'w')
  assert whole.dtype == torch.bfloat16
  for box in boxes:
    assert torch.equal(bf16_bits(stochastic_round_at(x[box], box, shape, 3, 'sr', 11, 'w')),
                       bf16_bits(whole[box]))


def lowbias32_noise_reference(key, i):
  """The noise of element i in Python integers: top 16 bits of lowbias32(lo(i) ^ seed ^ hi(i) * golden)."""
  mask = (1 << 32) - 1
  seed = rng.key_to_seed(*key)
  x = (i & mask) ^ ((seed ^ (seed >> 32)) & mask) ^ (((i >> 32) * 0x9E3779B9) & mask)
  x ^= x >> 16
  x = (x * 0x7FEB352D) & mask
  x ^= x >> 15
  x = (x * 0x846CA68B) & mask
  return (x ^ (x >> 16)) >> 16


def test_noise_is_the_top_of_lowbias32_of_the_global_index():
  # Pinned to the reference, so a checkpoint resumed by another version rounds the same way;
  # the wrapping int32 multiplies and masked shifts must match uint32 arithmetic exactly.
  shape, box = (300, 7), (slice(250, 300), slice(2, 7))
  expected = [[lowbias32_noise_reference((5, 'sr', 2, 'emb'), r * 7 + c) for c in range(2, 7)]
              for r in range(250, 300)]
  assert keyed_noise(box, shape, 5, 'sr', 2, 'emb').tolist() == expected
  # Indices past 2^32 (tensors of over 4G elements) mix their high word in.
  big = torch.tensor([3, 2**32 + 3, 2**40 + 7, 2**33 - 1], dtype=torch.int64)
  seed = torch.tensor(stochastic_rounding.key_seed(1, 'big'), dtype=torch.int32)
  assert stochastic_rounding.noise_at(big, seed).tolist() == [lowbias32_noise_reference((1, 'big'), i) for i in big.tolist()]
  # int32 indices (tensors of at most 2^31 elements, optim/sr_update.py's loops) hash alike.
  small = torch.tensor([0, 3, 2**20 + 5, 2**31 - 1], dtype=torch.int64)
  assert torch.equal(stochastic_rounding.noise_at(small.int(), seed), stochastic_rounding.noise_at(small, seed))
  assert stochastic_rounding.layout_dtype((2**16, 2**15)) == torch.int32 and stochastic_rounding.layout_dtype((2**16 + 1, 2**15)) == torch.int64


def test_same_key_same_noise_and_different_keys_differ():
  shape = (64, 64)
  a = keyed_noise(full_box(shape), shape, 7, 'sr', 3, 'w')
  assert torch.equal(a, keyed_noise(full_box(shape), shape, 7, 'sr', 3, 'w'))
  torch.manual_seed(0)                                               # the global RNG plays no part
  assert torch.equal(a, keyed_noise(full_box(shape), shape, 7, 'sr', 3, 'w'))
  for other in [(8, 'sr', 3, 'w'), (7, 'sr', 4, 'w'), (7, 'sr', 3, 'b'), (7, 'sr', 3)]:
    b = keyed_noise(full_box(shape), shape, *other)
    assert (a != b).float().mean() > 0.99                           # equal by chance: 1 in 2^16


def test_noise_is_close_to_uniform_and_uncorrelated():
  n = 1 << 20
  noise = keyed_noise(full_box((1024, 1024)), (1024, 1024), 0, 'uniform').flatten().double()
  assert noise.min() >= 0 and noise.max() < 1 << 16
  # Uniform on [0, 2^16): mean 32767.5, sd 2^16 / sqrt(12); the bounds are > 10 standard errors.
  assert abs(noise.mean().item() - 32767.5) < 10 * 2**16 / math.sqrt(12 * n)
  for bucket in [noise // 4096, noise % 16]:                        # high and low bits alike
    counts = torch.bincount(bucket.long(), minlength=16).double()
    chi_square = ((counts - n / 16)**2 / (n / 16)).sum().item()
    assert chi_square < 80                                          # 15 dof: mean 15, sd 5.5
  # Neighbouring elements, and the same element one step later, are independent draws.
  later = keyed_noise(full_box((1024, 1024)), (1024, 1024), 0, 'uniform', 1).flatten().double()
  for a, b in [(noise[:-1], noise[1:]), (noise, later)]:
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 10 / math.sqrt(n)


def test_bad_boxes_are_refused():
  with pytest.raises(ValueError, match='box'):
    keyed_noise((slice(0, 2),), (2, 3), 0)
  with pytest.raises(ValueError, match='box'):
    keyed_noise((0, slice(0, 3)), (2, 3), 0)
  with pytest.raises(ValueError, match='noise'):                   # box and x disagree
    stochastic_round_at(torch.zeros(2, 3), (slice(0, 1), slice(0, 3)), (2, 3), 0)


def test_keyed_rounding_is_always_a_bf16_neighbour():
  x = random_fp32(20000, 3)
  x = x[torch.isfinite(x)][:19600].view(140, 140)
  down, up = bf16_neighbours(x)
  box = (slice(60, 200), slice(0, 140))                             # a shard of a larger tensor
  went_up = torch.zeros(x.shape, dtype=torch.bool)
  for step in range(8):
    r = stochastic_round_at(x, box, (300, 140), 0, 'neighbours', step)
    is_down, is_up = bf16_bits(r) == bf16_bits(down), bf16_bits(r) == bf16_bits(up)
    assert (is_down | is_up).all()
    went_up |= is_up
  exact = (x.view(torch.int32) & 0xFFFF) == 0
  assert not went_up[exact].any()
  assert went_up[~exact].float().mean() > 0.5                        # not a plain truncation


@pytest.mark.parametrize('x', [1.0 + 0.3 * BF16_ULP_AT_ONE, -(1.0 + 0.9 * BF16_ULP_AT_ONE),
                               3.14159, -2.7e-3, 1e-3 * 2**-126, 12345.678])
def test_keyed_rounding_is_unbiased_in_expectation(x):
  shape = (400, 500)
  n = shape[0] * shape[1]
  xs = torch.full(shape, x)
  x = xs[0, 0].double().item()                                       # the fp32 value rounded
  down, up = (v.double().item() for v in bf16_neighbours(xs[0, :1]))
  p_up = (x - down) / (up - down)
  standard_error = abs(up - down) * math.sqrt(p_up * (1 - p_up) / n)
  box = (slice(100, 500), slice(0, 500))                             # rows of a larger tensor
  mean = stochastic_round_at(xs, box, (800, 500), 0, 'unbiased', x).double().mean().item()
  assert abs(mean - x) < 5 * standard_error
  nearest_error = abs(xs[0, :1].bfloat16().double().item() - x)
  assert nearest_error > 20 * standard_error                         # RTN is biased; SR is not


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
def test_noise_is_the_same_on_cuda_and_cpu():
  shape, box = (1000, 300), (slice(10, 900), slice(100, 300))
  cpu = keyed_noise(box, shape, 1, 'sr', 2, 'w')
  cuda = keyed_noise(box, shape, 1, 'sr', 2, 'w', device='cuda')
  assert cuda.device.type == 'cuda' and torch.equal(cuda.cpu(), cpu)
  x = torch.randn(890, 200) * 10
  assert torch.equal(stochastic_round_at(x.cuda(), box, shape, 1, 'w').cpu(),
                     stochastic_round_at(x, box, shape, 1, 'w'))


def test_rounding_many_tensors_at_once_is_bitwise_the_rounding_of_each():
  g = torch.Generator().manual_seed(0)
  items = [(torch.randn(5, 3, generator=g), (slice(2, 7), slice(0, 3)), (9, 3), (7, 'sr', 1, 'a')),
           (torch.randn(4, generator=g) * 1e3, (slice(0, 4),), (4,), (7, 'sr', 1, 'b', 'exp_avg'))]
  for got, (x, box, shape, key) in zip(stochastic_rounding.stochastic_round_many(items), items):
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, stochastic_rounding.stochastic_round_at(x, box, shape, *key))
  assert stochastic_rounding.stochastic_round_many([]) == []


def test_quarter_ulp_rounds_up_a_quarter_of_the_time_over_neighbouring_elements():
  # Statistical quality of the hash where it is used: one value over 1e5 consecutive indices
  # (one tensor's elements) rounds up with frequency 1/4, within a few binomial sigmas, for
  # any key; and whether one element rounds up says nothing about its neighbour's.
  n, p = 100_000, 0.25
  x = torch.full((n,), 1.0 + p * BF16_ULP_AT_ONE)
  for step in range(4):
    up = (stochastic_round_at(x, (slice(7 * n, 8 * n),), (10 * n,), 11, 'sr', step, 'w').float() > 1.0).double()
    assert abs(up.mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert abs(torch.corrcoef(torch.stack([up[:-1], up[1:]]))[0, 1].item()) < 5 / math.sqrt(n)


def test_noise_of_consecutive_keys_and_strided_elements_is_uncorrelated():
  n = 1 << 18
  shape = (512, 512)
  a = keyed_noise(full_box(shape), shape, 0, 'sr', 1, 'w').flatten().double()
  others = [keyed_noise(full_box(shape), shape, 0, 'sr', 1, 'w', 'exp_avg').flatten().double(),
            keyed_noise(full_box(shape), shape, 0, 'sr', 2, 'w').flatten().double()]
  pairs = [(a, b) for b in others] + [(a[:-d], a[d:]) for d in (1, 2, 512, 4096)]  # row and power-of-two lags
  for x, y in pairs:
    assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1].item()) < 6 / math.sqrt(n)


@pytest.mark.parametrize('shape, boxes', list(layouts()))
def test_index_layout_gives_every_boxs_global_indices_in_at_most_its_own_dims(shape, boxes):
  for box in [full_box(shape)] + boxes:
    sizes, layout = stochastic_rounding.index_layout(box, shape)
    expected = stochastic_rounding._flat_index(box, shape, torch.device('cpu'))
    got = stochastic_rounding.index_from_layout(sizes, torch.tensor(layout))
    assert torch.equal(got.reshape(-1), expected.reshape(-1)), box
    narrow = stochastic_rounding.index_from_layout(sizes, torch.tensor(layout, dtype=stochastic_rounding.layout_dtype(shape)))
    assert narrow.dtype == torch.int32 and torch.equal(narrow.reshape(-1).long(), expected.reshape(-1)), box
    assert len(sizes) <= max(len(shape), 1)
  assert len(stochastic_rounding.index_layout(((slice(2, 5), slice(0, 6))), (10, 6))[0]) == 1   # rows: one run
  with pytest.raises(ValueError, match='contiguous'):
    stochastic_rounding.index_layout((slice(0, 6, 2),), (6,))
