"""model/mla.py and DeepSeek-V3 through model/hf.py: latent attention (a query bottleneck, the shared
RoPE key part stored interleaved, values narrower than keys, YaRN's mscale), sigmoid routing within
the best expert groups with the correction bias and the routed scaling, an ungated shared expert
and dense first layers, made by transformers' own DeepseekV3ForCausalLM: its logits and every
gradient after import, a bit-exact export, KV-cache decoding, the converters, refusals by name."""
import copy
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip('transformers')

from model import hf, hf_export, lora, mla
from model.hf_names import file_name
from tests.test_hf import BASE_MODEL, VOCAB, _randomize, random_tokens
from tests.test_hf_families import _logit_error, decoding_error, greedy_equals_transformers, losses_after_backward

TOL = 1e-4        # fp32 max |logit difference|
YARN = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 16,
        'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0}
CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16,
              q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
              num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=VOCAB, max_position_embeddings=64,
              rope_parameters=YARN)


def hf_model(seed=0, **overrides):
  config = transformers.DeepseekV3Config(**dict(CONFIG, **overrides))
  config._attn_implementation = 'eager'
  torch.manual_seed(seed)
  model = transformers.DeepseekV3ForCausalLM(config).float().eval()
  _randomize(model.named_parameters(), seed)
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():          # a correction bias that changes the choice (HF starts it at zero)
    for name, buffer in model.named_buffers():
      if name.endswith('e_score_correction_bias'):
        buffer.copy_(0.3 * torch.randn(buffer.shape, generator=g))
  return model


def imported(tmp_path, seed=0, **overrides):
  model = hf_model(seed, **overrides)
  model.save_pretrained(tmp_path / 'theirs')
  m, params = hf.load_hf(str(tmp_path / 'theirs'), BASE_MODEL)
  return model, m, params


def test_config_reads_every_feature():
  m = hf.config_from_hf(transformers.DeepseekV3Config(**CONFIG).to_dict(), BASE_MODEL)
  assert mla.enabled(m) and (m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.v_head_dim, m.mla.rope_interleave) == \
      (16, 24, 12, True)
  assert m.head_dim == mla.qk_head_dim(m) == 24
  assert (m.moe.num_experts, m.moe.num_groups, m.moe.top_k_groups, m.moe.routed_scaling_factor) == (8, 4, 2, 2.5)
  assert (m.moe.router_activation, m.moe.load_balance_bias, m.moe.shared_expert_gate) == ('sigmoid', True, False)
  assert (m.moe.dense_layers, m.moe.shared_expert_intermediate_size, m.moe.ffn_hidden_size) == ((0,), 32, 32)
  assert (m.rope_scaling.type, m.rope_scaling.mscale_all_dim) == ('yarn', 1.0)


@pytest.mark.parametrize('q_lora_rank', [24, None])
def test_logits_loss_and_every_gradient_equal_transformers(q_lora_rank, tmp_path):
  """With the query bottleneck and without (DeepSeek-V2-Lite's one q_proj)."""
  model, m, params = imported(tmp_path, q_lora_rank=q_lora_rank)
  params = {n: t.requires_grad_(n in lora.trainable(m, [n])) for n, t in params.items()}
  tokens = random_tokens(4, b=2)
  assert _logit_error(params, m, model, tokens[:, :-1]) < TOL
  ours, theirs = losses_after_backward(params, m, model, tokens)
  assert abs(ours - theirs) < TOL
  hf_grads = {n.removeprefix('model.'): p.grad for n, p in model.named_parameters()}
  for name, p in params.items():
    if not p.requires_grad:          # the correction bias: chosen with, never trained
      assert name.endswith('e_score_correction_bias') and p.grad is None
      continue
    if '.mlp.experts.' in name:      # transformers 5 holds gate and up as one [E, 2f, h]
      stacked = hf_grads[name.rsplit('.', 1)[0] + ('.down_proj' if name.endswith('down_proj') else '.gate_up_proj')]
      expected = stacked if name.endswith('down_proj') else stacked.chunk(2, dim=1)[name.endswith('up_proj')]
    else:
      stored = file_name(name, m).removeprefix('model.')     # DeepSeek's shared expert is `shared_experts`
      expected = hf_grads[stored][:VOCAB] if name == 'lm_head.weight' else hf_grads[stored]
    grad = p.grad[:VOCAB] if name in hf.VOCAB_PARAMS else p.grad
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=lambda msg, name=name: f'{name}: {msg}')


def test_each_feature_changes_the_logits(tmp_path):
  model, m, params = imported(tmp_path)
  tokens = random_tokens(5, s=24)
  ablations = [dict(mla=dict(rope_interleave=False)), dict(moe=dict(num_groups=1)), dict(moe=dict(load_balance_bias=False)),
               dict(moe=dict(routed_scaling_factor=1.0)), dict(rope_scaling=dict(mscale_all_dim=0.0))]
  for keys in ablations:
    ablated = copy.deepcopy(m)
    for section, values in keys.items():
      ablated[section].update(values)
    assert _logit_error(params, ablated, model, tokens) > 1e-3, keys


def test_export_is_bit_exact_and_transformers_loads_it(tmp_path):
  model, m, params = imported(tmp_path)
  hf.save_hf(str(tmp_path / 'ours'), m, params)
  theirs, ours = load_file(tmp_path / 'theirs' / hf.WEIGHTS_FILE), load_file(tmp_path / 'ours' / hf.WEIGHTS_FILE)
  assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], t) for n, t in theirs.items())
  again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / 'ours', attn_implementation='eager')
  tokens = random_tokens(6, s=24)
  with torch.no_grad():
    assert (again.float().eval()(tokens).logits - model(tokens).logits).abs().max().item() < TOL
  assert hf.load_hf(str(tmp_path / 'ours'), BASE_MODEL)[0].to_dict() == m.to_dict()


def test_the_multi_token_prediction_layer_of_a_release_is_skipped_as_transformers_does(tmp_path):
  """DeepSeek-V3's files hold one more layer (61 of 0-60: multi-token prediction), which
  transformers does not load; neither does flatron (MTP training is not built)."""
  model, m, params = imported(tmp_path)
  tensors = load_file(tmp_path / 'theirs' / hf.WEIGHTS_FILE)
  tensors['model.layers.3.eh_proj.weight'] = torch.zeros(64, 128)
  save_file(tensors, tmp_path / 'theirs' / hf.WEIGHTS_FILE, metadata={'format': 'pt'})
  again = hf.load_hf(str(tmp_path / 'theirs'), BASE_MODEL)[1]
  assert again.keys() == params.keys() and all(torch.equal(again[n], params[n]) for n in params)


def test_decoding_with_the_kv_cache_gives_the_whole_sequence_logits(tmp_path):
  model, m, params = imported(tmp_path)
  tokens = random_tokens(7, b=1, s=12)
  assert decoding_error(params, m, tokens) < 1e-5
  assert greedy_equals_transformers(params, m, model, tokens[:, :8], 4)


def test_through_the_converters_and_a_checkpoint(tmp_path):
  from tools import convert  # pylint: disable=import-outside-toplevel
  model = hf_model()
  model.save_pretrained(tmp_path / 'theirs')
  step = convert.hf_to_flatron(str(tmp_path / 'theirs'), str(tmp_path / 'ckpt'))
  convert.flatron_to_hf(step, str(tmp_path / 'back'))
  again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / 'back', attn_implementation='eager')
  tokens = random_tokens(8, s=24)
  with torch.no_grad():
    assert (again.float().eval()(tokens).logits - model(tokens).logits).abs().max().item() < TOL


def test_a_quantized_release_is_refused_naming_the_method(tmp_path):
  """DeepSeek-V3's own files are FP8 with block scales: refused before any tensor is read."""
  import json  # pylint: disable=import-outside-toplevel
  hf_model().save_pretrained(tmp_path)
  config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
  config['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'weight_block_size': [128, 128]}
  (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(config))
  with pytest.raises(hf.HFFileError, match="quant_method='fp8': these weights are quantized"):
    hf.load_hf(str(tmp_path), BASE_MODEL)


def test_what_deepseek_v3_cannot_be_is_refused_by_name():
  m = hf.config_from_hf(transformers.DeepseekV3Config(**CONFIG).to_dict(), BASE_MODEL)
  m.moe.shared_expert_gate = True
  with pytest.raises(ValueError, match='are HF DeepSeek-V3 together'):
    hf_export.config_to_hf(m)
