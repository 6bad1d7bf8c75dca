"""model/hf_gpt_oss.py through model/hf.py: gpt-oss (attention sinks, biases on every linear, the
clamped SwiGLU, YaRN, sliding and full layers alternating) made by transformers' own
GptOssForCausalLM imports with its logits and every gradient, exports back bit for bit, and its
MXFP4 checkpoints import dequantized exactly as transformers dequantizes them."""
import copy
import json
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip('transformers')
mxfp4 = pytest.importorskip('transformers.integrations.mxfp4')

from model import hf, hf_export, hf_gpt_oss, transformer
from tests.test_hf import BASE_MODEL, VOCAB, _randomize, random_tokens
from tests.test_hf_families import _logit_error, decoding_error, greedy_equals_transformers, losses_after_backward

TOL = 1e-4        # fp32 max |logit difference|
YARN = {'rope_type': 'yarn', 'rope_theta': 150000.0, 'factor': 4.0, 'beta_fast': 32.0, 'beta_slow': 1.0,
        'truncate': False, 'original_max_position_embeddings': 16}
# swiglu_limit 0.5: the random model's gates pass it, so the clamp is on (an ablation below proves it)
CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.5, rope_parameters=YARN)


def hf_model(seed=0, **overrides):
  config = transformers.GptOssConfig(**dict(CONFIG, **overrides))
  config._attn_implementation = 'eager'
  torch.manual_seed(seed)
  model = transformers.GptOssForCausalLM(config).float().eval()
  _randomize(model.named_parameters(), seed)
  return model


def imported(tmp_path, seed=0):
  model = hf_model(seed)
  model.save_pretrained(tmp_path / 'theirs')
  m, params = hf.load_hf(str(tmp_path / 'theirs'), BASE_MODEL)
  return model, m, params


def in_hf_names(ours, m):
  """Our tensors (gradients) under transformers' names and layouts, vocab rows unpadded."""
  out = {}
  for i in range(m.num_layers):
    out.update(hf_gpt_oss.to_hf(ours, f'layers.{i}'))
  for name, t in ours.items():
    if not hf_gpt_oss.is_renamed(name):
      out[hf.to_hf_name(name)] = t[:VOCAB] if name in hf.VOCAB_PARAMS else t
  return out


def test_config_reads_every_feature():
  m = hf.config_from_hf(transformers.GptOssConfig(**CONFIG).to_dict(), BASE_MODEL)
  assert (m.architecture, m.attention_sinks, m.has_bias, m.rmsnorm_scale_in_fp32) == ('gpt_oss', True, True, True)
  assert transformer.layer_types(m) == ('sliding_attention', 'full_attention') * 2 and m.sliding_window == 5
  assert (m.rope_scaling.type, m.rope_scaling.truncate, m.rope_scaling.factor) == ('yarn', False, 4.0)
  assert (m.moe.num_experts, m.moe.top_k, m.moe.normalize_top_k_affinities, m.moe.frequency) == (4, 2, True, 1)
  assert (m.moe.expert_activation, m.moe.swiglu_alpha, m.moe.swiglu_limit) == ('clamped_swiglu', 1.702, 0.5)


def test_logits_loss_and_every_gradient_equal_transformers(tmp_path):
  model, m, params = imported(tmp_path)
  params = {n: t.requires_grad_() for n, t in params.items()}
  tokens = random_tokens(4, b=2)
  assert _logit_error(params, m, model, tokens[:, :-1]) < TOL
  ours, theirs = losses_after_backward(params, m, model, tokens)
  assert abs(ours - theirs) < TOL
  ours = in_hf_names({n: p.grad for n, p in params.items()}, m)
  hf_grads = {n: p.grad for n, p in model.named_parameters()}
  assert ours.keys() == hf_grads.keys()
  for name, grad in hf_grads.items():
    torch.testing.assert_close(ours[name], grad, atol=1e-5, rtol=1e-4, msg=lambda msg, name=name: f'{name}: {msg}')


def test_each_feature_changes_the_logits(tmp_path):
  """Sinks, the clamp and the sliding layers each matter in this model: had one been dropped,
  the logit test above would have seen it."""
  model, m, params = imported(tmp_path)
  tokens = random_tokens(5, s=24)
  for keys in (dict(attention_sinks=False), dict(sliding_window=0, layer_types=()), dict(moe=dict(swiglu_limit=1e9))):
    ablated = copy.deepcopy(m)
    for key, value in keys.items():
      ablated[key].update(value) if isinstance(value, dict) else ablated.update({key: value})
    assert _logit_error(params, ablated, model, tokens) > 1e-3, keys


def test_export_is_bit_exact_and_transformers_loads_it(tmp_path):
  model, m, params = imported(tmp_path)
  hf.save_hf(str(tmp_path / 'ours'), m, params)
  assert json.loads((tmp_path / 'ours' / hf.CONFIG_FILE).read_text())['model_type'] == 'gpt_oss'
  theirs, ours = load_file(tmp_path / 'theirs' / hf.WEIGHTS_FILE), load_file(tmp_path / 'ours' / hf.WEIGHTS_FILE)
  assert ours.keys() == theirs.keys()
  for name, tensor in theirs.items():
    assert torch.equal(ours[name], tensor), name
  again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / 'ours', attn_implementation='eager')
  tokens = random_tokens(6, s=24)
  with torch.no_grad():
    assert (again.float().eval()(tokens).logits - model(tokens).logits).abs().max().item() < TOL
  assert hf.load_hf(str(tmp_path / 'ours'), BASE_MODEL)[0].to_dict() == m.to_dict()


def _mxfp4(shape, generator):
  """Random MXFP4 blocks [..., G, 16] and scales [..., G] (powers of two near 1)."""
  blocks = torch.randint(0, 256, shape + (16,), dtype=torch.uint8, generator=generator)
  return blocks, torch.randint(124, 130, shape, dtype=torch.uint8, generator=generator)


def test_dequantize_is_transformers_own():
  blocks, scales = _mxfp4((3, 8, 2), torch.Generator().manual_seed(0))
  theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # [E, in, out]
  assert torch.equal(hf_gpt_oss.dequantize(blocks, scales), theirs.transpose(1, 2))


def test_an_mxfp4_checkpoint_imports_as_its_dequantized_weights(tmp_path):
  """OpenAI's layout (blocks and scales for both expert weights) against the same weights
  dequantized by transformers into its unquantized layout: equal, whole and box by box."""
  model = hf_model()
  model.save_pretrained(tmp_path / 'plain')
  tensors, g = load_file(tmp_path / 'plain' / hf.WEIGHTS_FILE), torch.Generator().manual_seed(1)
  e, h, f = CONFIG['num_local_experts'], CONFIG['hidden_size'], CONFIG['intermediate_size']
  quantized, dequantized = dict(tensors), dict(tensors)
  for name in [n for n in tensors if n.endswith(('experts.gate_up_proj', 'experts.down_proj'))]:
    rows, cols = (2 * f, h) if name.endswith('gate_up_proj') else (h, f)
    blocks, scales = _mxfp4((e, rows, cols // 32), g)
    del quantized[name]
    quantized[name + '_blocks'], quantized[name + '_scales'] = blocks, scales
    dequantized[name] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
  for kind, saved in (('mxfp4', quantized), ('dequantized', dequantized)):
    os.makedirs(tmp_path / kind)
    save_file(saved, tmp_path / kind / hf.WEIGHTS_FILE, metadata={'format': 'pt'})
    (tmp_path / kind / hf.CONFIG_FILE).write_text((tmp_path / 'plain' / hf.CONFIG_FILE).read_text())
  m, ours = hf.load_hf(str(tmp_path / 'mxfp4'), BASE_MODEL)
  _, expected = hf.load_hf(str(tmp_path / 'dequantized'), BASE_MODEL)
  assert ours.keys() == expected.keys() and all(torch.equal(ours[n], expected[n]) for n in ours)
  boxes = {'layers.1.mlp.experts.up_proj': (slice(1, 3), slice(8, 40), slice(0, h)),      # EP x TP boxes
           'layers.1.mlp.experts.down_proj': (slice(2, 4), slice(0, h), slice(32, 64)),
           'layers.1.mlp.experts.gate_proj_bias': (slice(0, 2), slice(16, 48))}
  parts = hf.read_boxes(str(tmp_path / 'mxfp4'), m, boxes)
  for name, box in boxes.items():
    assert torch.equal(parts[name], ours[name][box]), name


def test_what_gpt_oss_cannot_be_is_refused_by_name():
  with pytest.raises(ValueError, match='attention_bias=False: gpt-oss\'s router and experts keep their biases'):
    hf.config_from_hf(transformers.GptOssConfig(**dict(CONFIG, attention_bias=False)).to_dict(), BASE_MODEL)
  with pytest.raises(ValueError, match=r"experts_per_token=3 \(OpenAI's key\) but the experts a token runs are "
                                       r'num_experts_per_tok=2'):
    hf.config_from_hf(dict(transformers.GptOssConfig(**CONFIG).to_dict(), experts_per_token=3), BASE_MODEL)
  m = hf.config_from_hf(transformers.GptOssConfig(**CONFIG).to_dict(), BASE_MODEL)
  m.attention_sinks = False
  with pytest.raises(ValueError, match='are HF gpt-oss together'):
    hf_export.config_to_hf(m)


def test_decoding_with_the_kv_cache_gives_the_whole_sequence_logits(tmp_path):
  """Generation's cache path (sinks over the cached keys, the window over them too) against
  one forward over the whole sequence, and transformers' greedy continuation."""
  model, m, params = imported(tmp_path)
  tokens = random_tokens(7, b=1, s=12)
  assert decoding_error(params, m, tokens) < 1e-5
  assert greedy_equals_transformers(params, m, model, tokens[:, :8], 4)


def test_through_the_converters_and_a_checkpoint(tmp_path):
  """tools.convert hf-to-flatron writes a checkpoint step, flatron-to-hf writes it back: the same
  logits in transformers (the renamed expert tensors through the checkpoint's names)."""
  from tools import convert  # pylint: disable=import-outside-toplevel
  model = hf_model()
  model.save_pretrained(tmp_path / 'theirs')
  step = convert.hf_to_flatron(str(tmp_path / 'theirs'), str(tmp_path / 'ckpt'))
  convert.flatron_to_hf(step, str(tmp_path / 'back'))
  again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / 'back', attn_implementation='eager')
  tokens = random_tokens(8, s=24)
  with torch.no_grad():
    assert (again.float().eval()(tokens).logits - model(tokens).logits).abs().max().item() < TOL
