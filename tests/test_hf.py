"""model/hf.py: HF Llama import/export gives the same logits and loss, and round-trips bit-exactly."""
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
from model import hf, transformer

VOCAB = 300        # not a multiple of 128: exercises the vocab padding
BASE_MODEL = base_config.get_config().model   # what HF does not set comes from here
SEQ = 16
TOL = 1e-5


def _hf_config(**overrides):
  kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5)
  kwargs.update(overrides)
  return transformers.LlamaConfig(**kwargs)


def _randomize(named_tensors, seed):
  """Random norm weights and biases (HF's init, zero biases and unit norms, would let a
  misplaced one go unnoticed); fan-in scaling keeps logits O(1), so 1e-5 is a few fp32 ulps."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, t in named_tensors:
      noise = torch.randn(t.shape, generator=g)
      if 'norm' in name:
        t.copy_(1 + 0.2 * noise)
      elif t.dim() == 1:
        t.copy_(0.2 * noise)
      else:
        t.copy_(noise / t.shape[1] ** 0.5)


def _hf_model(config, seed=0):
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).float().eval()
  _randomize(model.named_parameters(), seed)
  return model


def _tokens(seed, b=2, s=SEQ + 1):
  return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def _load_pretrained(path):
  return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation='eager').float().eval()


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
  config = _hf_config(**CASES[case])
  config._attn_implementation = 'eager'
  model = _hf_model(config)
  model.save_pretrained(tmp_path, safe_serialization=True,
                        **({'max_shard_size': '40KB'} if case == 'sharded' else {}))
  assert os.path.exists(tmp_path / hf.INDEX_FILE) == (case == 'sharded')

  m, params = hf.load_hf(str(tmp_path), BASE_MODEL)
  assert params['embed_tokens.weight'].shape[0] == transformer.padded_vocab_size(m) == 384
  assert m.share_embeddings_and_output_weights == (case == 'tied')
  assert m.rope_theta == CASES[case].get('rope_theta', 10000.0)
  assert m.rope_scaling.type == CASES[case].get('rope_scaling', {}).get('rope_type', 'none')
  tokens = _tokens(1)
  with torch.no_grad():
    ours = transformer.forward(params, tokens, m)[..., :VOCAB]
    theirs = model(tokens).logits
  err = (ours - theirs).abs().max().item()
  print(f'{case}: max |logit error| = {err:.2e}')
  assert err < TOL


def _flatron_config(**model_overrides):
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
  cfg = _flatron_config(**overrides)
  params = _flatron_params(cfg)
  hf.save_hf(str(tmp_path), cfg.model, params, max_shard_bytes=max_shard_bytes)
  assert os.path.exists(tmp_path / hf.INDEX_FILE) == (max_shard_bytes is not None)
  model = _load_pretrained(tmp_path)

  sequence = _tokens(2)
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
  cfg = _flatron_config(has_bias=True)
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
  cfg = _flatron_config(share_embeddings_and_output_weights=True)
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


@pytest.mark.parametrize('rope', [
    dict(rope_theta=5e5, rope_scaling=None),                                  # transformers 4.x
    dict(rope_parameters={'rope_theta': 5e5, 'rope_type': 'default'}),       # transformers 5.x
    dict(rope_theta=5e5, rope_scaling={'type': 'default'}),                  # older 4.x spelling
], ids=['4.x', '5.x', 'legacy_type'])
def test_rope_theta_from_either_layout(rope):
  config = dict(model_type='llama', hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=VOCAB, **rope)
  assert hf.config_from_hf(config, BASE_MODEL).rope_theta == 5e5


def test_config_from_hf_sets_the_model_section_and_keeps_the_rest_of_the_base():
  base = base_config.get_config().model
  base.optim.lr, base.hidden_dropout = 1e-3, 0.1
  config = dict(model_type='llama', hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, vocab_size=VOCAB)
  m = hf.config_from_hf(config, base)
  assert (m.num_layers, m.ffn_hidden_size, m.vocab_size) == (3, 96, VOCAB)
  assert (m.optim.lr, m.hidden_dropout) == (1e-3, 0.1)
  assert base.num_layers == base_config.get_config().model.num_layers     # a copy: base untouched


def test_model_hf_does_not_import_configs():
  code = 'import sys, model.hf; print(sorted(m for m in sys.modules if m.startswith("configs")))'
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.stdout.strip() == '[]'


def _saved(tmp_path):
  cfg = _flatron_config()
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


def test_error_unsupported_rope_scaling():
  config = _hf_config(max_position_embeddings=8192).to_dict()
  config['rope_scaling'] = {'rope_type': 'yarn', 'factor': 8.0}
  with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='yarn'"):
    hf.config_from_hf(config, BASE_MODEL)


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


def test_error_inexpressible_config():
  with pytest.raises(ValueError, match='normalization'):
    hf.config_to_hf(_flatron_config(normalization='layernorm').model)


@pytest.mark.parametrize('family, overrides', [
    ('llama', dict(rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                                 'high_freq_factor': 4.0, 'original_max_position_embeddings': 32})),
    ('qwen2', dict(num_key_value_heads=2)),
    ('qwen2', dict(num_key_value_heads=2, tie_word_embeddings=True)),
])
def test_families_import_and_export_with_equal_logits(family, overrides, tmp_path):
  """Llama 3.1's RoPE scaling and Qwen2 (biases on q, k, v only): logits equal transformers'
  on import, and the export loads in transformers as the same family with the same logits."""
  classes = {'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
             'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
  config_class, model_class = classes[family]
  kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, **overrides)
  torch.manual_seed(0)
  model = model_class(config_class(**kwargs)).float().eval()
  _randomize(model.named_parameters(), 0)
  model.save_pretrained(tmp_path / 'theirs')
  m, params = hf.load_hf(str(tmp_path / 'theirs'), BASE_MODEL)
  assert m.qkv_bias == (family == 'qwen2') and not m.has_bias
  tokens = _tokens(2)
  with torch.no_grad():
    ours = transformer.forward(params, tokens, m)[..., :VOCAB]
    theirs = model(tokens).logits
  print(f'{family} {overrides}: max |logit error| = {(ours - theirs).abs().max().item():.2e}')
  assert (ours - theirs).abs().max().item() < TOL
  hf.save_hf(str(tmp_path / 'ours'), m, params)
  assert json.load(open(tmp_path / 'ours' / 'config.json'))['model_type'] == family
  again = model_class.from_pretrained(tmp_path / 'ours').float().eval()
  with torch.no_grad():
    assert (again(tokens).logits - theirs).abs().max().item() < TOL
  assert hf.load_hf(str(tmp_path / 'ours'), BASE_MODEL)[0].rope_scaling.to_dict() == m.rope_scaling.to_dict()


def test_sliding_window_is_refused_by_name():
  config = dict(model_type='qwen2', hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=VOCAB, use_sliding_window=True)
  with pytest.raises(ValueError, match='use_sliding_window'):
    hf.config_from_hf(config, BASE_MODEL)
