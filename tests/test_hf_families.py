"""Qwen3, Qwen3-MoE, OLMo 2, SmolLM3, Phi-3 and Llama 4 through model/hf.py: each family, with every feature
it adds over Llama on in one small random model made by transformers' own classes, gives
transformers' logits after import and after export, imports back to the same model section, and
round-trips its safetensors bit for bit."""
import copy
import json
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip('transformers')

from model import hf, hf_export, moe, transformer
from tests.test_hf import BASE_MODEL, VOCAB, _randomize, random_tokens

TOL = 1e-4        # fp32 max |logit difference|
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {     # name -> (config class, model class, config overrides: every feature of the family on)
    # per-head q/k norms, head_dim 32 with 4 heads != hidden 64, layers from max_window_layers slide
    'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM',
              dict(head_dim=32, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    # no shared expert, norm_topk_prob, experts every 2nd layer but layer 3 (mlp_only_layers)
    'qwen3_moe': ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM',
                  dict(head_dim=32, num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])),
    # q/k norms over the whole projection, norms after attention and MLP only
    'olmo2': ('Olmo2Config', 'Olmo2ForCausalLM', dict()),
    # no RoPE in every 2nd layer, those layers slide
    'smollm3': ('SmolLM3Config', 'SmolLM3ForCausalLM',
                dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5)),
    # fused qkv_proj and gate_up_proj, half of each head rotated, one window everywhere
    'phi3': ('Phi3Config', 'Phi3ForCausalLM',
             dict(sliding_window=5, rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0,
                                                     'partial_rotary_factor': 0.5})),
    # chunked attention (5) on the RoPE layers with interleaved rotary pairs and L2 q/k norms, NoPE
    # layers with the temperature (floor 4), MoE every 2nd layer: top-1 sigmoid scaling the
    # expert's input, a shared expert; dense layers of their own width, Llama 3.1's RoPE scaling
    'llama4_text': ('Llama4TextConfig', 'Llama4ForCausalLM',
                    dict(num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
                         num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                         no_rope_layer_interval=2, attention_chunk_size=5, floor_scale=4, attn_scale=0.5,
                         rope_parameters={'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0,
                                          'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                          'original_max_position_embeddings': 16})),
}


def hf_model(family, seed=0, **overrides):
  config_class, model_class, features = FAMILIES[family]
  config = getattr(transformers, config_class)(**dict(SMALL, **features, **overrides))
  config._attn_implementation = 'eager'
  torch.manual_seed(seed)
  model = getattr(transformers, model_class)(config).float().eval()
  _randomize(model.named_parameters(), seed)
  return model


def imported(family, tmp_path, seed=0):
  model = hf_model(family, seed)
  model.save_pretrained(tmp_path / 'theirs')
  m, params = hf.load_hf(str(tmp_path / 'theirs'), BASE_MODEL)
  return model, m, params


def _logit_error(params, m, model, tokens):
  with torch.no_grad():
    return (transformer.forward(params, tokens, m)[..., :VOCAB] - model(tokens).logits).abs().max().item()


def losses_after_backward(params, m, model, tokens):
  """(our mean next-token loss, transformers' cross-entropy) over `tokens`, each backward once."""
  batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(tokens[:, 1:].shape))
  loss, _ = transformer.stage(params, batch, m)
  ours = loss / batch['labels'].numel()
  ours.backward()
  theirs = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
  theirs.backward()
  return ours.item(), theirs.item()


@torch.no_grad()
def decoding_error(params, m, tokens, prefix=6):
  """Max |difference| between the logits of `tokens` decoded with the KV cache (the first
  `prefix` at once, then one at a time) and of one forward over them all."""
  whole = transformer.forward(params, tokens, m)
  logits, cache = transformer.decode(params, tokens[:, :prefix], m)
  steps = [logits]
  for i in range(prefix, tokens.shape[1]):
    logits, cache = transformer.decode(params, tokens[:, i:i + 1], m, cache)
    steps.append(logits)
  return (torch.cat(steps, dim=1) - whole).abs().max().item()


@torch.no_grad()
def greedy_equals_transformers(params, m, model, prompt, new_tokens):
  """Whether greedy decoding continues `prompt` with transformers' own `generate` tokens."""
  theirs = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
  ours = prompt
  for _ in range(new_tokens):
    ours = torch.cat([ours, transformer.forward(params, ours, m)[:, -1, :VOCAB].argmax(-1, keepdim=True)], dim=1)
  return torch.equal(ours, theirs)


def _ablations(m):
  """Copies of model section `m`, each with one of its family's features switched off (those that
  need no other parameters): each must change the logits, or the test would not see it."""
  switches = {'qk_norm': dict(qk_norm=False), 'sliding_window': dict(sliding_window=0, layer_types=()),
              'attention_chunk_size': dict(attention_chunk_size=0, layer_types=()), 'qk_l2_norm': dict(qk_l2_norm=False),
              'rope_interleave': dict(rope_interleave=False), 'attn_temperature_tuning': dict(attn_temperature_tuning=False),
              'nope_layers': dict(nope_layers=()), 'rotary_percentage': dict(rotary_percentage=1.0),
              'rmsnorm_scale_in_fp32': dict(rmsnorm_scale_in_fp32=False)}
  out = {}
  for feature, keys in switches.items():
    if m[feature] not in (0, 0.0, False, (), 1.0) or (feature == 'rotary_percentage' and m[feature] != 1.0):
      out[feature] = copy.deepcopy(m)
      out[feature].update(keys)
  return out


@pytest.mark.parametrize('family', FAMILIES)
def test_family_imports_and_exports_with_transformers_logits(family, tmp_path):
  model, m, params = imported(family, tmp_path)
  assert m.architecture == hf.FAMILIES[family][1]
  tokens = random_tokens(3, s=24)
  err = _logit_error(params, m, model, tokens)
  print(f'{family}: max |logit error| = {err:.2e}')
  assert err < TOL
  for feature, ablated in _ablations(m).items():
    if feature == 'rmsnorm_scale_in_fp32':        # the same in fp32: only its bf16 rounding differs
      continue
    assert _logit_error(params, ablated, model, tokens) > 1e-3, f'{family}: {feature} off changes nothing'

  hf.save_hf(str(tmp_path / 'ours'), m, params)
  written = json.loads((tmp_path / 'ours' / hf.CONFIG_FILE).read_text())
  assert written['model_type'] == family
  assert load_file(tmp_path / 'ours' / hf.WEIGHTS_FILE).keys() == load_file(tmp_path / 'theirs' / hf.WEIGHTS_FILE).keys()
  for name, tensor in load_file(tmp_path / 'theirs' / hf.WEIGHTS_FILE).items():
    assert torch.equal(load_file(tmp_path / 'ours' / hf.WEIGHTS_FILE)[name], tensor), name
  again = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / 'ours', attn_implementation='eager')
  with torch.no_grad():
    assert (again.float().eval()(tokens).logits - model(tokens).logits).abs().max().item() < TOL
  m2 = hf.load_hf(str(tmp_path / 'ours'), BASE_MODEL)[0]
  assert m2.to_dict() == m.to_dict()


def test_each_family_reads_its_features():
  sections = {}
  for family, (config_class, _, features) in FAMILIES.items():
    config = getattr(transformers, config_class)(**dict(SMALL, **features)).to_dict()
    sections[family] = hf.config_from_hf(config, BASE_MODEL)
  qwen3, moe, olmo2, smol, phi3, llama4 = (sections[f] for f in FAMILIES)
  assert (qwen3.qk_norm, qwen3.qk_norm_span, qwen3.head_dim) == (True, 'head', 32)
  assert transformer.layer_types(qwen3) == ('full_attention', 'sliding_attention', 'sliding_attention')
  assert (moe.moe.num_experts, moe.moe.shared_expert_intermediate_size, moe.moe.normalize_top_k_affinities) == (4, 0, True)
  assert [i for i in range(6) if transformer.moe.is_moe_layer(moe, i)] == [1, 5]
  assert (olmo2.qk_norm_span, olmo2.post_norms_only, olmo2.rmsnorm_scale_in_fp32) == ('projection', True, True)
  assert smol.nope_layers == (1, 3)
  assert transformer.layer_types(smol) == ('full_attention', 'sliding_attention') * 2
  assert (phi3.rotary_percentage, phi3.sliding_window, transformer.layer_types(phi3)) == \
      (0.5, 5, ('sliding_attention',) * 3)
  assert (llama4.nope_layers, llama4.moe.dense_layers, llama4.attention_chunk_size) == ((1, 3), (0, 2), 5)
  assert transformer.layer_types(llama4) == ('chunked_attention', 'full_attention') * 2
  assert (llama4.ffn_hidden_size, llama4.moe.ffn_hidden_size, llama4.moe.shared_expert_intermediate_size) == (96, 32, 32)
  assert (llama4.moe.router_activation, llama4.moe.scale_expert_input, llama4.moe.normalize_top_k_affinities) == \
      ('sigmoid', True, False)


def test_an_olmo2_norm_without_its_block_is_refused_by_name():
  m = hf.config_from_hf(getattr(transformers, 'Olmo2Config')(**SMALL).to_dict(), BASE_MODEL)
  m.post_norms_only = False
  with pytest.raises(ValueError, match='post_norms_only, rmsnorm_scale_in_fp32 and qk_norm.*OLMo 2 together'):
    hf_export.config_to_hf(m)
  m = copy.deepcopy(BASE_MODEL)
  m.rotary_percentage = 0.5
  m.has_bias = True
  with pytest.raises(ValueError, match='has_bias=True: HF phi3 has no such biases'):
    hf_export.config_to_hf(m)


def test_llama4_loss_and_every_gradient_equal_transformers(tmp_path):
  """The input-scaling router, the temperature and the chunks in the backward too."""
  model, m, params = imported('llama4_text', tmp_path)
  params = {n: t.requires_grad_() for n, t in params.items()}
  tokens = random_tokens(4, s=24)
  ours, theirs = losses_after_backward(params, m, model, tokens)
  assert abs(ours - theirs) < TOL
  grads = {n: p.grad for n, p in model.named_parameters()}
  for name, p in params.items():
    stored = hf.file_name(name, m) if not moe.is_expert_param(name) else None
    if stored is None:               # [E, h, 2f] gate then up, [E, f, h]: ours transposed
      base, kind = name.rsplit('.', 1)
      stack = grads[hf.file_name(base, m) + ('.down_proj' if kind == 'down_proj' else '.gate_up_proj')]
      expected = stack.transpose(1, 2) if kind == 'down_proj' else stack.chunk(2, dim=-1)[kind == 'up_proj'].transpose(1, 2)
    else:
      expected = grads[stored][:VOCAB] if name in hf.VOCAB_PARAMS else grads[stored]
    grad = p.grad[:VOCAB] if name in hf.VOCAB_PARAMS else p.grad
    if name == 'embed_tokens.weight':   # HF's nn.Embedding(padding_idx=pad_token_id 0) never trains row 0
      grad, expected = grad[1:], expected[1:]
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=lambda msg, name=name: f'{name}: {msg}')


@pytest.mark.parametrize('family', ['qwen3_moe', 'phi3', 'llama4_text'])
def test_family_through_the_converters_and_a_checkpoint(family, tmp_path):
  """tools.convert hf-to-flatron writes a checkpoint step, flatron-to-hf writes it back: the
  same logits in transformers (the fused and per-expert tensors through the checkpoint's names)."""
  from tools import convert  # pylint: disable=import-outside-toplevel
  model = hf_model(family)
  model.save_pretrained(tmp_path / 'theirs')
  step = convert.hf_to_flatron(str(tmp_path / 'theirs'), str(tmp_path / 'ckpt'))
  convert.flatron_to_hf(step, str(tmp_path / 'back'))
  again = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / 'back', attn_implementation='eager')
  tokens = random_tokens(4, s=24)
  with torch.no_grad():
    assert (again.float().eval()(tokens).logits - model(tokens).logits).abs().max().item() < TOL


def test_llama4_decodes_with_the_kv_cache_as_transformers_generates(tmp_path):
  """Chunks, NoPE layers' temperature and the interleaved RoPE over cached positions: decoding
  step by step gives the whole sequence's logits, and greedy tokens are transformers' own."""
  model, m, params = imported('llama4_text', tmp_path)
  tokens = random_tokens(7, b=1, s=12)
  assert decoding_error(params, m, tokens) < 1e-5
  assert greedy_equals_transformers(params, m, model, tokens[:, :8], 6)
