"""model/hf.py: HF Llama, Mistral, Qwen2 and Gemma 3 import/export gives the same logits and
loss, round-trips bit-exactly, and names the file in its errors (config.json mapping: test_hf_config.py;
gradients, packed windows and decoding against transformers: test_transformer.py)."""
import copy
import json
import os
import subprocess
import sys

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip('transformers')

from configs import base as base_config
from model import hf, param_table, transformer

VOCAB = 300        # not a multiple of 128: exercises the vocab padding
BASE_MODEL = base_config.get_config().model   # what HF does not set comes from here
SEQ = 16
TOL = 1e-5


def _randomize(named_tensors, seed, norm_center=1.0):
  """Random norm weights and biases (HF's init, zero biases and unit norms, would let a
  misplaced one go unnoticed); fan-in scaling keeps logits O(1), so 1e-5 is a few fp32 ulps.
  Gemma's norms scale by (1 + w): there norm_center=0 keeps the scale near 1."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, t in named_tensors:
      noise = torch.randn(t.shape, generator=g)
      if 'norm' in name:
        t.copy_(norm_center + 0.2 * noise)
      elif t.dim() == 1:
        t.copy_(0.2 * noise)
      else:
        t.copy_(noise / t.shape[1] ** 0.5)


FAMILY_CLASSES = {'llama': ('LlamaConfig', 'LlamaForCausalLM'),          # HF model_type -> its classes
                  'mistral': ('MistralConfig', 'MistralForCausalLM'),
                  'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM'),
                  'gemma3_text': ('Gemma3TextConfig', 'Gemma3ForCausalLM')}


def family_config(family, **overrides):
  kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5)
  kwargs.update(overrides)
  config = getattr(transformers, FAMILY_CLASSES[family][0])(**kwargs)
  config._attn_implementation = 'eager'
  return config


def family_model(family, overrides, seed=0):
  """A fresh (no dynamic-RoPE state yet) random fp32 HF model of `family` (HF model_type)."""
  torch.manual_seed(seed)
  model = getattr(transformers, FAMILY_CLASSES[family][1])(family_config(family, **overrides)).float().eval()
  _randomize(model.named_parameters(), seed, norm_center=0.0 if family == 'gemma3_text' else 1.0)
  return model


def _load_family(path, family):
  model_class = getattr(transformers, FAMILY_CLASSES[family][1])
  return model_class.from_pretrained(path, attn_implementation='eager').float().eval()


def random_tokens(seed, b=2, s=SEQ + 1):
  return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


CASES = {
    'mha': dict(),
    'gqa': dict(num_key_value_heads=2),
    'tied': dict(tie_word_embeddings=True),
    'bias': dict(attention_bias=True, mlp_bias=True),
    'rope_theta': dict(rope_theta=500000.0, num_hidden_layers=3),
    # Llama 3.1's scaling: head dim 16 puts one frequency in each band (kept, blended, divided)
    'rope_llama3': dict(rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                                      'high_freq_factor': 4.0, 'original_max_position_embeddings': 32}),
    'rope_linear': dict(rope_scaling={'rope_type': 'linear', 'factor': 4.0}),
    'sharded': dict(num_key_value_heads=2),
}


@pytest.mark.parametrize('case', CASES)
def test_hf_to_flatron_logits(case, tmp_path):
  model = family_model('llama', CASES[case])
  model.save_pretrained(tmp_path, safe_serialization=True,
                        **({'max_shard_size': '40KB'} if case == 'sharded' else {}))
  assert os.path.exists(tmp_path / hf.INDEX_FILE) == (case == 'sharded')

  m, params = hf.load_hf(str(tmp_path), BASE_MODEL)
  assert params['embed_tokens.weight'].shape[0] == param_table.padded_vocab_size(m) == 384
  assert m.share_embeddings_and_output_weights == (case == 'tied')
  assert m.rope_theta == CASES[case].get('rope_theta', 10000.0)
  assert m.rope_scaling.type == CASES[case].get('rope_scaling', {}).get('rope_type', 'none')
  tokens = random_tokens(1)
  with torch.no_grad():
    ours = transformer.forward(params, tokens, m)[..., :VOCAB]
    theirs = model(tokens).logits
  err = (ours - theirs).abs().max().item()
  print(f'{case}: max |logit error| = {err:.2e}')
  assert err < TOL


def flatron_config(**model_overrides):
  cfg = base_config.get_config()
  cfg.model.update(dict(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                        num_kv_heads=2, num_layers=2, rope_theta=50000.0, layernorm_epsilon=1e-5))
  cfg.model.update(model_overrides)
  return cfg


def _flatron_params(cfg, seed=3):
  params = transformer.init(cfg.model, seed)
  _randomize(params.items(), seed)
  return params


@pytest.mark.parametrize('overrides, max_shard_bytes', [
    (dict(), None),
    (dict(share_embeddings_and_output_weights=True, has_bias=True), None),
    (dict(), 30_000),
], ids=['untied', 'tied_bias', 'sharded'])
def test_flatron_to_hf_logits_and_loss(overrides, max_shard_bytes, tmp_path):
  cfg = flatron_config(**overrides)
  params = _flatron_params(cfg)
  hf.save_hf(str(tmp_path), cfg.model, params, max_shard_bytes=max_shard_bytes)
  assert os.path.exists(tmp_path / hf.INDEX_FILE) == (max_shard_bytes is not None)
  model = _load_family(tmp_path, 'llama')

  sequence = random_tokens(2)
  batch = dict(tokens=sequence[:, :-1], labels=sequence[:, 1:], loss_mask=torch.ones(2, SEQ))
  with torch.no_grad():
    ours_logits = transformer.forward(params, batch['tokens'], cfg.model)[..., :VOCAB]
    ours_loss = transformer.loss_sum(params, batch, cfg.model) / batch['loss_mask'].sum()
    # HF shifts labels itself: logits at positions 0..SEQ-1 predict tokens 1..SEQ.
    out = model(sequence, labels=sequence)
  logit_err = (ours_logits - out.logits[:, :-1]).abs().max().item()
  loss_err = abs(ours_loss.item() - out.loss.item())
  print(f'{overrides}: max |logit error| = {logit_err:.2e}, |loss error| = {loss_err:.2e}')
  assert logit_err < TOL
  assert loss_err < TOL


@pytest.mark.parametrize('max_shard_bytes', [None, 30_000], ids=['single', 'sharded'])
def test_round_trip_bit_exact(max_shard_bytes, tmp_path):
  cfg = flatron_config(has_bias=True)
  params = {n: t.detach() for n, t in _flatron_params(cfg).items()}
  for name in hf.VOCAB_PARAMS:
    params[name][VOCAB:] = 0   # padded rows are not part of the HF format; they load as zeros
  hf.save_hf(str(tmp_path), cfg.model, params, max_shard_bytes=max_shard_bytes)
  assert os.path.exists(tmp_path / hf.INDEX_FILE) == (max_shard_bytes is not None)
  assert os.path.exists(tmp_path / hf.WEIGHTS_FILE) == (max_shard_bytes is None)
  loaded_model, loaded = hf.load_hf(str(tmp_path), BASE_MODEL)
  assert loaded.keys() == params.keys()
  for name in params:
    assert loaded[name].dtype == params[name].dtype and torch.equal(loaded[name], params[name]), name
  for key in ('num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads', 'num_kv_heads',
              'vocab_size', 'rope_theta', 'layernorm_epsilon', 'has_bias', 'share_embeddings_and_output_weights'):
    assert loaded_model[key] == cfg.model[key], key


def test_tied_file_with_lm_head_loads(tmp_path):
  """Some writers store the tied head anyway; it is the embedding, so it is dropped."""
  cfg = flatron_config(share_embeddings_and_output_weights=True)
  params = _flatron_params(cfg)
  hf.save_hf(str(tmp_path), cfg.model, params)
  file = str(tmp_path / hf.WEIGHTS_FILE)
  tensors = load_file(file)
  assert 'lm_head.weight' not in tensors
  tensors['lm_head.weight'] = tensors['model.embed_tokens.weight'].clone()
  save_file(tensors, file, metadata={'format': 'pt'})
  _, loaded = hf.load_hf(str(tmp_path), BASE_MODEL)
  assert 'lm_head.weight' not in loaded
  assert torch.equal(loaded['embed_tokens.weight'][:VOCAB], params['embed_tokens.weight'][:VOCAB])


def test_model_hf_does_not_import_configs():
  code = 'import sys, model.hf; print(sorted(m for m in sys.modules if m.startswith("configs")))'
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.stdout.strip() == '[]'


def _saved(tmp_path):
  cfg = flatron_config()
  hf.save_hf(str(tmp_path), cfg.model, _flatron_params(cfg))
  return cfg


def test_error_missing_config(tmp_path):
  with pytest.raises(FileNotFoundError, match='config.json'):
    hf.load_hf(str(tmp_path), BASE_MODEL)


def test_error_wrong_model_type(tmp_path):
  _saved(tmp_path)
  config_path = tmp_path / hf.CONFIG_FILE
  config = json.loads(config_path.read_text())
  config.update(model_type='gpt2', architectures=['GPT2LMHeadModel'])
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r'config\.json.*gpt2'):
    hf.load_hf(str(tmp_path), BASE_MODEL)


def test_error_missing_tensor(tmp_path):
  _saved(tmp_path)
  file = str(tmp_path / hf.WEIGHTS_FILE)
  tensors = load_file(file)
  del tensors['model.layers.1.mlp.up_proj.weight']
  save_file(tensors, file, metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=r'model\.safetensors.*missing.*model\.layers\.1\.mlp\.up_proj\.weight'):
    hf.load_hf(str(tmp_path), BASE_MODEL)


def test_error_shape_mismatch(tmp_path):
  _saved(tmp_path)
  file = str(tmp_path / hf.WEIGHTS_FILE)
  tensors = load_file(file)
  tensors['model.layers.0.self_attn.k_proj.weight'] = torch.zeros(8, 64)
  save_file(tensors, file, metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=r'model\.safetensors.*k_proj\.weight.*\(8, 64\).*\(32, 64\)'):
    hf.load_hf(str(tmp_path), BASE_MODEL)


# --- the families: Llama, Mistral, Qwen2, Gemma 3 ------------------------------------------


LLAMA3_ROPE = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               'original_max_position_embeddings': 32}
# head_dim 32 != hidden / heads; the window (5) is shorter than the sequence (17)
GEMMA3 = dict(num_key_value_heads=2, head_dim=32, sliding_window=5, query_pre_attn_scalar=24, num_hidden_layers=3,
              layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
              rope_parameters={'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
                               'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}})
FAMILY_CASES = {      # name -> (HF model_type, config overrides)
    'llama_rope_llama3': ('llama', dict(rope_scaling=LLAMA3_ROPE)),
    # dynamic NTK: the 17 positions pass max_position_embeddings=8, so the base is raised
    'llama_rope_dynamic': ('llama', dict(rope_scaling={'rope_type': 'dynamic', 'factor': 2.0},
                                         max_position_embeddings=8)),
    'mistral_window5': ('mistral', dict(sliding_window=5, num_key_value_heads=2)),
    'mistral_no_window': ('mistral', dict(sliding_window=None)),
    'qwen2_gqa': ('qwen2', dict(num_key_value_heads=2)),
    'qwen2_tied': ('qwen2', dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # layer 0 full, layers 1 and 2 sliding (HF: the layers from max_window_layers on slide)
    'qwen2_window5': ('qwen2', dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                    num_hidden_layers=3, num_key_value_heads=2)),
    'gemma3': ('gemma3_text', GEMMA3),
}
# the model-section keys an import sets, compared after export and re-import
SECTION_KEYS = ('architecture', 'num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads',
                'num_kv_heads', 'head_dim', 'vocab_size', 'max_position_embeddings', 'rope_theta',
                'rope_local_theta', 'sliding_window', 'layer_types', 'activation', 'has_bias', 'qkv_bias',
                'layernorm_epsilon', 'share_embeddings_and_output_weights', 'query_pre_attn_scalar') + hf.GEMMA_KEYS


def imported(case, tmp_path, seed=0):
  """(HF model, our model section, our params) of FAMILY_CASES[case], through save_pretrained + load_hf."""
  model = family_model(*FAMILY_CASES[case], seed)
  model.save_pretrained(tmp_path / 'theirs')
  m, params = hf.load_hf(str(tmp_path / 'theirs'), BASE_MODEL)
  return model, m, params


def _ablations(m):
  """Copies of model section `m` with one of its features switched off, each of which must
  change the logits: proof that the test exercises the window, the scaling, the local base."""
  out = {}
  if m.sliding_window:
    out['sliding_window'] = copy.deepcopy(m)
    out['sliding_window'].sliding_window = 0
  if m.rope_scaling.type != 'none':
    out['rope_scaling'] = copy.deepcopy(m)
    out['rope_scaling'].rope_scaling.type = 'none'
  if m.rope_local_theta:
    out['rope_local_theta'] = copy.deepcopy(m)
    out['rope_local_theta'].rope_local_theta = 0.0
  return out


@pytest.mark.parametrize('case', FAMILY_CASES)
def test_families_import_and_export_with_equal_logits(case, tmp_path):
  """Each family's logits equal transformers' on import; the export loads in transformers as
  the same family with the same logits, and imports back to the same model section."""
  family, overrides = FAMILY_CASES[case]
  model, m, params = imported(case, tmp_path)
  assert m.architecture == hf.FAMILIES[family][1]
  assert m.qkv_bias == (family == 'qwen2') and not m.has_bias
  assert all(m[key] == (family == 'gemma3_text') for key in hf.GEMMA_KEYS)
  expected_types = {'mistral_window5': ('sliding_attention',) * 2,
                    'qwen2_window5': ('full_attention', 'sliding_attention', 'sliding_attention'),
                    'gemma3': tuple(GEMMA3['layer_types'])}.get(case, ('full_attention',) * m.num_layers)
  assert transformer.layer_types(m) == expected_types
  assert m.sliding_window == (5 if 'sliding_attention' in expected_types else 0)
  if family == 'gemma3_text':
    assert (m.rope_theta, m.rope_local_theta, m.head_dim, m.query_pre_attn_scalar) == (1e6, 1e4, 32, 24)
    assert m.activation == 'geglu' and m.share_embeddings_and_output_weights
  tokens = random_tokens(2)
  with torch.no_grad():
    ours = transformer.forward(params, tokens, m)[..., :VOCAB]
    theirs = model(tokens).logits
    err = (ours - theirs).abs().max().item()
    print(f'{case}: max |logit error| = {err:.2e} (logit scale {theirs.abs().max().item():.1f})')
    assert err < TOL
    explicit = copy.deepcopy(m)                  # the explicit-softmax path masks the same way
    explicit.fusions.flash_attention = False
    assert (transformer.forward(params, tokens, explicit)[..., :VOCAB] - theirs).abs().max().item() < TOL
    for feature, ablated in _ablations(m).items():
      off = (transformer.forward(params, tokens, ablated)[..., :VOCAB] - theirs).abs().max().item()
      assert off > 1e-3, f'{case}: switching {feature} off leaves the logits unchanged ({off:.1e})'

  hf.save_hf(str(tmp_path / 'ours'), m, params)
  assert json.loads((tmp_path / 'ours' / hf.CONFIG_FILE).read_text())['model_type'] == family
  again = _load_family(tmp_path / 'ours', family)       # fresh: no dynamic-RoPE state
  assert type(again) is type(model)
  with torch.no_grad():
    export_err = (again(tokens).logits - theirs).abs().max().item()
  assert export_err < TOL, export_err
  m2 = hf.load_hf(str(tmp_path / 'ours'), BASE_MODEL)[0]
  for key in SECTION_KEYS:
    assert m2[key] == m[key], (key, m2[key], m[key])
  assert m2.rope_scaling.to_dict() == m.rope_scaling.to_dict()


@pytest.mark.parametrize('case', ['mistral_window5', 'mistral_no_window', 'qwen2_window5', 'gemma3'])
def test_hf_round_trip_bit_exact(case, tmp_path):
  """HF's file -> load_hf -> save_hf -> load_hf: the same tensors bit for bit (and the same as
  HF wrote), and the same model section."""
  family = FAMILY_CASES[case][0]
  _, m, params = imported(case, tmp_path)
  hf.save_hf(str(tmp_path / 'ours'), m, params)
  m2, params2 = hf.load_hf(str(tmp_path / 'ours'), BASE_MODEL)
  assert params2.keys() == params.keys()
  for name in params:
    assert params2[name].dtype == params[name].dtype and torch.equal(params2[name], params[name]), name
  assert m2.to_dict() == m.to_dict()
  theirs, ours = load_file(str(tmp_path / 'theirs' / hf.WEIGHTS_FILE)), load_file(str(tmp_path / 'ours' / hf.WEIGHTS_FILE))
  assert ours.keys() == theirs.keys()
  assert all(torch.equal(ours[name], theirs[name]) for name in ours)
  hf.save_hf(str(tmp_path / 'again'), m2, params2)     # and the config is a fixed point
  assert (tmp_path / 'again' / hf.CONFIG_FILE).read_text() == (tmp_path / 'ours' / hf.CONFIG_FILE).read_text()
  assert json.loads((tmp_path / 'ours' / hf.CONFIG_FILE).read_text())['model_type'] == family
