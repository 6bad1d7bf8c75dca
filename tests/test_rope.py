"""RoPE against its definition and transformers': the rotate-half, the YaRN and longrope
frequencies and attention factors, partial rotary, HF's rope settings read and written, and
tiny HF models with each scaling giving transformers' logits."""
import copy
import math
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch

from configs import base as base_config
from model import checks, defaults, hf, rope, transformer

transformers = pytest.importorskip('transformers')
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402  pylint: disable=wrong-import-position


def test_rope_scores_depend_only_on_relative_position():
  d = 16
  q, k = torch.randn(d), torch.randn(d)

  def rotated(v, pos):
    cos, sin = rope.rope_cos_sin(torch.tensor([[pos]]), d, 10000.0, torch.float32)
    return rope.apply_rope(v.view(1, 1, 1, d), cos, sin).flatten()

  s1 = rotated(q, 7) @ rotated(k, 3)
  s2 = rotated(q, 104) @ rotated(k, 100)
  torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
  torch.testing.assert_close(rotated(q, 0), q)
  assert math.isclose(rotated(q, 5).norm().item(), q.norm().item(), rel_tol=1e-5)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_rope_is_transformers_rotate_half_bit_for_bit(dtype):
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
  q, k = torch.randn(2, 4, 16, 32).to(dtype), torch.randn(2, 2, 16, 32).to(dtype)
  cos, sin = rope.rope_cos_sin(torch.arange(16)[None].expand(2, -1) * 37, 32, 10000.0, dtype)
  want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
  assert torch.equal(rope.apply_rope(q, cos, sin), want_q)
  assert torch.equal(rope.apply_rope(k, cos, sin), want_k)


def test_partial_rope_passes_the_tail_through():
  x = torch.randn(1, 2, 3, 8)
  cos, sin = rope.rope_cos_sin(torch.arange(3)[None] + 1, 4, 10000.0, torch.float32)
  out = rope.apply_rope(x, cos, sin)
  assert torch.equal(out[..., 4:], x[..., 4:])
  assert not torch.allclose(out[..., :4], x[..., :4])


# --- YaRN, longrope and partial rotary against transformers -------------------------------

SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=128, rms_norm_eps=1e-5)
HEAD_DIM = 16
YARN = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32}   # Qwen3's 128k, scaled down
YARN_CASES = {
    'qwen3': {},
    'no_truncate': dict(truncate=False),                         # gpt-oss
    'mscale_ratio': dict(mscale=1.0, mscale_all_dim=0.8),        # DeepSeek-style: the ratio of the two
    'mscale_alone': dict(mscale=0.7),                            # HF uses it only with mscale_all_dim
    'attention_factor': dict(attention_factor=1.3),
    'betas': dict(beta_fast=16, beta_slow=2),
    'factor_derived': dict(factor=None),             # HF: max_position_embeddings / original (128 / 32)
    'partial': dict(partial_rotary_factor=0.5),
}
SHORT, LONG = [1.0, 1.1, 1.3, 1.6], [1.0, 2.0, 4.0, 9.0]          # Phi-3's lists, one per rotated frequency
PHI3_ROPE = dict(rope_type='longrope', short_factor=SHORT, long_factor=LONG, partial_rotary_factor=0.5)


def _section(hf_dict):
  """The model section rope.from_hf's values give (the rest from model/defaults.py)."""
  m = defaults.model_section()
  m.hidden_size, m.num_attention_heads = hf_dict['hidden_size'], hf_dict['num_attention_heads']
  m.max_position_embeddings = hf_dict['max_position_embeddings']
  m.rope_theta, scaling, _, m.rotary_percentage = rope.from_hf(hf_dict)
  m.rope_scaling.update(scaling)
  return m


def freq_rtol(theta, roundings=8):
  """float32 frequencies (transformers') against ours in float64: HF's base ** (i / dim) in fp32
  carries the exponent's rounding times ln(base), then a few more roundings (the power itself,
  the scaling's divisions and blends)."""
  return (math.log(theta) + roundings) * torch.finfo(torch.float32).eps


def _rot_dim(m):
  return int(transformer.head_dim(m) * m.rotary_percentage) // 2 * 2


def _assert_tables_close(cos_sin, want, positions):
  """cos, sin against HF's: both computed from the angle p x f, HF's in fp32 (p ulps of f's)."""
  atol = 4 * positions * 2.0 ** -23
  for ours, theirs in zip(cos_sin, want):
    torch.testing.assert_close(ours[:, 0], theirs, atol=atol, rtol=0)


def _yarn_config(case):
  return transformers.Qwen3Config(**SIZES, head_dim=HEAD_DIM, rope_parameters=dict(YARN, rope_theta=1e4, **YARN_CASES[case]))


@pytest.mark.parametrize('case', YARN_CASES)
def test_yarn_frequencies_and_tables_equal_transformers(case):
  config = _yarn_config(case)
  m = _section(config.to_dict())
  want_freq, want_factor = ROPE_INIT_FUNCTIONS['yarn'](config)
  assert m.rope_scaling.type == 'yarn' and math.isclose(rope.attention_factor(m.rope_scaling), want_factor)
  ours = rope.rope_inv_freq(_rot_dim(m), m.rope_theta, m.rope_scaling)
  torch.testing.assert_close(ours.float(), want_freq, rtol=freq_rtol(m.rope_theta), atol=0)
  assert not torch.allclose(ours.float(), rope.rope_inv_freq(_rot_dim(m), m.rope_theta).float())
  positions = torch.arange(64)[None].expand(2, -1)
  rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)
  want = rotary(torch.zeros(1, dtype=torch.float32), positions)
  _assert_tables_close(rope.rope_cos_sin(positions, _rot_dim(m), m.rope_theta, torch.float32, m.rope_scaling,
                                         m.max_position_embeddings), want, 64)


def _phi3_config(**overrides):
  kwargs = dict(SIZES, num_attention_heads=2, hidden_size=32, original_max_position_embeddings=32, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
  kwargs.update(overrides)
  return transformers.Phi3Config(**kwargs)


@pytest.mark.parametrize('layout', ['4.x', '5.x'])
def test_longrope_switches_factors_past_the_original_context_as_transformers(layout):
  """Phi-3 / Phi-4-mini: short factors while the batch's positions stay within
  original_max_position_embeddings (32), long ones past it; partial rotary (half of each head)."""
  config = _phi3_config(rope_parameters=dict(PHI3_ROPE, rope_theta=10000.0))
  if layout == '4.x':     # Phi-3's own files: rope_scaling, the rest at the top level, no factor
    hf_dict = dict(config.to_dict(), rope_parameters=None, partial_rotary_factor=0.5, rope_theta=10000.0,
                   rope_scaling={'type': 'longrope', 'short_factor': SHORT, 'long_factor': LONG})
  else:
    hf_dict = dict(config.to_dict(), original_max_position_embeddings=None)
  m = _section(hf_dict)
  r = m.rope_scaling
  assert (r.type, r.factor, r.original_max_position_embeddings, m.rotary_percentage) == ('longrope', 4.0, 32, 0.5)
  assert (r.short_factor, r.long_factor) == (tuple(SHORT), tuple(LONG))
  rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
  assert math.isclose(rope.attention_factor(r), rotary.attention_scaling)
  assert math.isclose(rope.attention_factor(r), math.sqrt(1 + math.log(4) / math.log(32)))
  for seq_len, factors in [(32, SHORT), (33, LONG), (16, SHORT)]:        # HF switches back too
    want_freq, _ = ROPE_INIT_FUNCTIONS['longrope'](config, seq_len=seq_len)
    ours = rope.rope_inv_freq(_rot_dim(m), m.rope_theta, r, seq_len)
    torch.testing.assert_close(ours.float(), want_freq, rtol=freq_rtol(m.rope_theta), atol=0)
    torch.testing.assert_close(ours, rope.rope_inv_freq(_rot_dim(m), m.rope_theta) / torch.tensor(factors).double())
    positions = torch.arange(seq_len)[None]
    want = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert want[0].shape[-1] == _rot_dim(m) == 8
    _assert_tables_close(rope.rope_cos_sin(positions, _rot_dim(m), m.rope_theta, torch.float32, r), want, seq_len)


def test_partial_rotary_reads_either_layout_and_rotates_as_phi3():
  """partial_rotary_factor from 5.x's rope_parameters or 4.x's top level; Phi-3's rotation of
  the first dims, the rest passed through, equals ours."""
  from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
  raw = dict(SIZES, model_type='llama', rope_theta=1e4)
  assert rope.from_hf(dict(raw, partial_rotary_factor=0.5))[3] == 0.5
  assert rope.from_hf(dict(raw, rope_parameters={'rope_type': 'default', 'partial_rotary_factor': 0.25}))[3] == 0.25
  assert rope.from_hf(raw)[3] == 1.0
  config = _phi3_config(rope_parameters={'rope_type': 'default', 'rope_theta': 1e4, 'partial_rotary_factor': 0.5})
  m = _section(config.to_dict())
  positions = torch.arange(24)[None]
  cos, sin = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)(torch.zeros(1), positions)
  ours = rope.rope_cos_sin(positions, _rot_dim(m), m.rope_theta, torch.float32)
  _assert_tables_close(ours, (cos, sin), 24)
  q, k = torch.randn(1, 2, 24, HEAD_DIM), torch.randn(1, 2, 24, HEAD_DIM)
  want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
  torch.testing.assert_close(rope.apply_rope(q, *ours), want_q, atol=1e-5, rtol=0)
  torch.testing.assert_close(rope.apply_rope(k, *ours), want_k, atol=1e-5, rtol=0)


ROUND_TRIPS = {     # model-section rope settings -> written as HF reads them, read back the same
    'yarn': dict(scaling=dict(YARN, type='yarn', rope_type=None)),
    'yarn_all_keys': dict(scaling=dict(YARN, type='yarn', rope_type=None, truncate=False, mscale=1.0,
                                       mscale_all_dim=0.8, beta_fast=16.0, beta_slow=2.0, attention_factor=1.2)),
    'longrope_partial': dict(scaling=dict(type='longrope', factor=4.0, original_max_position_embeddings=32,
                                          short_factor=tuple(SHORT), long_factor=tuple(LONG)), fraction=0.5),
    'partial': dict(scaling=dict(type='none'), fraction=0.5),
}


@pytest.mark.parametrize('case', ROUND_TRIPS)
@pytest.mark.parametrize('layout', ['4.x', '5.x'])
def test_to_hf_then_from_hf_round_trips_and_transformers_reads_the_same(case, layout):
  m = defaults.model_section()
  m.hidden_size, m.num_attention_heads, m.max_position_embeddings = 32, 2, 128
  m.rope_scaling.update({k: v for k, v in ROUND_TRIPS[case]['scaling'].items() if k != 'rope_type'})
  m.rotary_percentage = ROUND_TRIPS[case].get('fraction', 1.0)
  if m.rope_scaling.type == 'longrope':
    m.rope_scaling.short_factor, m.rope_scaling.long_factor = tuple(SHORT), tuple(LONG)
  written = rope.to_hf(m)
  hf_dict = dict(SIZES, **rope.to_hf_top_level(m))
  if layout == '4.x':
    hf_dict.update(rope_theta=m.rope_theta, rope_scaling=written)
  else:
    hf_dict['rope_parameters'] = dict(written, rope_theta=m.rope_theta)
  again = _section(hf_dict)
  assert again.rope_scaling.to_dict() == m.rope_scaling.to_dict()
  assert again.rotary_percentage == m.rotary_percentage
  # transformers 5 builds the same frequencies and attention factor from what was written
  config = transformers.Qwen3Config(**hf_dict, head_dim=HEAD_DIM)
  kind = config.rope_parameters['rope_type']
  assert kind == ('default' if m.rope_scaling.type == 'none' else m.rope_scaling.type)
  assert config.rope_parameters.get('partial_rotary_factor', 1.0) == m.rotary_percentage
  if kind != 'default':
    for seq_len in (0, 33):
      want_freq, want_factor = ROPE_INIT_FUNCTIONS[kind](config, seq_len=seq_len)
      torch.testing.assert_close(rope.rope_inv_freq(_rot_dim(m), m.rope_theta, m.rope_scaling, seq_len).float(),
                                 want_freq, rtol=freq_rtol(m.rope_theta), atol=0)
      assert math.isclose(rope.attention_factor(m.rope_scaling), want_factor)


def test_gemma3_full_layers_take_yarn_with_their_own_base():
  theta, scaling, local_theta, fraction = rope.from_hf(_raw(
      model_type='gemma3_text', rope_parameters={'full_attention': dict(YARN, rope_theta=1e6),
                                                 'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}))
  assert (theta, local_theta, fraction, scaling['type'], scaling['factor']) == (1e6, 1e4, 1.0, 'yarn', 4.0)


def _raw(**keys):
  return dict(dict(SIZES, model_type='llama'), **keys)


@pytest.mark.parametrize('hf_dict, match', [
    (_raw(rope_parameters={'rope_type': 'proportional', 'rope_theta': 1e4}), r"rope_parameters\.rope_type='proportional'"),
    (_raw(rope_scaling=dict(YARN, attention_factor=0.0)), r'rope_scaling\.attention_factor=0\.0 must be > 0'),
    (_raw(rope_scaling={'rope_type': 'linear'}), r'rope_scaling\.factor is missing'),
    (_raw(rope_scaling={'rope_type': 'longrope', 'short_factor': SHORT + SHORT}), r'rope_scaling\.long_factor is missing'),
    (_raw(rope_scaling={'rope_type': 'longrope', 'short_factor': SHORT, 'long_factor': LONG}),
     r'rope_scaling\.short_factor has 4 entries; .* rot_dim / 2 = 8'),
    (_raw(partial_rotary_factor=1.5), r'^partial_rotary_factor=1\.5 must be in \(0, 1\]'),
    (_raw(rope_parameters={'rope_type': 'default', 'partial_rotary_factor': 0.4375}),
     r'rotates int\(16 x 0\.4375\) = 7 dims per head, an odd count'),
    (_raw(layer_types=['full_attention', 'sliding_attention'],
          rope_parameters={'full_attention': dict(YARN, truncate=False), 'sliding_attention': {}}),
     r'rope_parameters\.full_attention\.truncate=False'),
    (_raw(layer_types=['full_attention', 'sliding_attention'],
          rope_parameters={'full_attention': {}, 'sliding_attention': dict(YARN)}),
     r"rope_parameters\.sliding_attention\.rope_type='yarn'"),
], ids=['unknown_type', 'attention_factor_0', 'factor_missing', 'long_factor_missing', 'factor_lengths',
        'fraction_above_1', 'odd_rotary_dims', 'nested_truncate', 'sliding_scaled'])
def test_from_hf_refusals_name_the_key(hf_dict, match):
  with pytest.raises(ValueError, match=match):
    rope.from_hf(hf_dict)


def test_model_checks_name_longrope_lengths_and_yarn_settings():
  m = base_config.get_config().model
  m.hidden_size, m.num_attention_heads, m.rotary_percentage = 32, 2, 0.5
  m.rope_scaling.update(dict(type='longrope', factor=4.0, original_max_position_embeddings=32,
                             short_factor=tuple(SHORT), long_factor=tuple(LONG)))
  assert checks.check(m, 16) == []                         # head 16, half rotated: 4 frequencies
  m.rotary_percentage = 1.0
  problems = '\n'.join(checks.check(m, 16))
  assert 'model.rope_scaling.short_factor has 4 entries' in problems and 'rot_dim / 2 = 8' in problems
  assert 'model.rope_scaling.long_factor has 4 entries' in problems
  m.rope_scaling.update(dict(type='yarn', beta_fast=1.0, beta_slow=32.0, mscale=-1.0, attention_factor=-2.0))
  problems = '\n'.join(checks.check(m, 16))
  for needed in ('yarn needs 0 < beta_slow <= beta_fast (got 32.0, 1.0', 'model.rope_scaling.mscale=-1.0',
                 'model.rope_scaling.attention_factor=-2.0'):
    assert needed in problems, needed
  m.rope_scaling.type = 'ntk'
  assert "model.rope_scaling.type='ntk' is unknown" in '\n'.join(checks.check(m, 16))


# --- end to end: a tiny HF model with each scaling, through load_hf and forward -------------


EIGHT_SHORT, EIGHT_LONG = [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5], [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0]
LONGROPE = dict(rope_type='longrope', short_factor=EIGHT_SHORT, long_factor=EIGHT_LONG,
                original_max_position_embeddings=32, rope_theta=1e4)
# Phi-3 keeps original_max_position_embeddings at the top level (its class defaults it to 4096)
PHI3 = dict(original_max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
END_TO_END = {      # name -> (HF class prefix, rope_parameters, sequence length, other config keys)
    'qwen2_yarn': ('Qwen2', dict(YARN, rope_theta=1e4), 24, {}),
    'llama_longrope_short': ('Llama', LONGROPE, 24, {}),
    'llama_longrope_long': ('Llama', LONGROPE, 48, {}),      # past original_max_position_embeddings=32
    'phi3_longrope_partial_long': ('Phi3', dict(PHI3_ROPE, rope_theta=1e4), 48, PHI3),
}


def _tiny_hf(prefix, rope_parameters, keys):
  """A random fp32 HF model: norms near 1, weights scaled by fan-in (logits O(1))."""
  torch.manual_seed(0)
  config = getattr(transformers, f'{prefix}Config')(**SIZES, **keys, rope_parameters=dict(rope_parameters))
  config._attn_implementation = 'eager'
  model = getattr(transformers, f'{prefix}ForCausalLM')(config).float().eval()
  with torch.no_grad():
    for name, t in model.named_parameters():
      noise = torch.randn(t.shape)
      t.copy_(1 + 0.2 * noise if 'norm' in name else 0.2 * noise if t.dim() == 1 else noise / t.shape[1] ** 0.5)
  return model


@pytest.mark.parametrize('case', END_TO_END)
def test_scaled_rope_models_give_transformers_logits(case, tmp_path):
  prefix, rope_parameters, seq, keys = END_TO_END[case]
  if prefix.lower() not in hf.FAMILIES:
    pytest.skip(f'model/hf.py does not import {prefix} models')
  model = _tiny_hf(prefix, rope_parameters, keys)
  model.save_pretrained(tmp_path / 'theirs')
  m, params = hf.load_hf(str(tmp_path / 'theirs'), base_config.get_config().model)
  assert m.rope_scaling.type == rope_parameters['rope_type']
  assert m.rotary_percentage == rope_parameters.get('partial_rotary_factor', 1.0)
  tokens = torch.randint(0, SIZES['vocab_size'], (2, seq), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    theirs = model(tokens).logits

    def error(section):
      return (transformer.forward(params, tokens, section)[..., :SIZES['vocab_size']] - theirs).abs().max().item()

    assert error(m) < 1e-4, error(m)
    # each part of the scaling shows in the logits: the frequencies, the attention factor, the switch
    ablations = {'type': dict(type='none'), 'attention_factor': dict(attention_factor=1.0)}
    if 'longrope' in case:      # the other factor list, at the same attention factor
      ablations['switch'] = dict(original_max_position_embeddings=64 if seq > 32 else 16,
                                 attention_factor=rope.attention_factor(m.rope_scaling))
    for what, changes in ablations.items():
      off = copy.deepcopy(m)
      off.rope_scaling.update(changes)
      assert error(off) > 1e-3, f'{case}: {what} left the logits unchanged'
    print(f'{case}: max |logit error| = {error(m):.1e}')
    hf.save_hf(str(tmp_path / 'ours'), m, params)                   # transformers reads our export the same
    again = type(model).from_pretrained(tmp_path / 'ours', attn_implementation='eager').float().eval()
    assert (again(tokens).logits - theirs).abs().max().item() < 1e-4
