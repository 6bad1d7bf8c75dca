"""model/hf_config.py: HF config.json <-> the model section, in the 4.x and 5.x layouts; what
HF does not set comes from the base; keys no family here implements are refused by name, on
import and on export; model_source=hf (configs/from_files.py) copies nested keys."""
import pytest

from configs import base as base_config, from_files
from model import hf
from tests.test_hf import BASE_MODEL, GEMMA3, LLAMA3_ROPE, VOCAB, family_config, flatron_config


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


def test_error_unsupported_rope_scaling():
  config = family_config('llama', max_position_embeddings=8192).to_dict()
  config['rope_scaling'] = {'type': 'mrope', 'mrope_section': [2, 3, 3]}     # Qwen2-VL's 4.x spelling
  with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='mrope'"):
    hf.config_from_hf(config, BASE_MODEL)


def test_error_inexpressible_config():
  with pytest.raises(ValueError, match='normalization'):
    hf.config_to_hf(flatron_config(normalization='layernorm').model)


def _gemma_dict(**overrides):
  return family_config('gemma3_text', **dict(GEMMA3, **overrides)).to_dict()


def _raw(model_type, **keys):
  return dict(dict(model_type=model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB), **keys)


@pytest.mark.parametrize('hf_config, match', [
    (lambda: _gemma_dict(final_logit_softcapping=30.0), r'final_logit_softcapping=30\.0'),
    (lambda: _gemma_dict(attn_logit_softcapping=50.0), r'attn_logit_softcapping=50\.0'),
    (lambda: _raw('qwen2', use_sliding_window=True, sliding_window=4,
                  layer_types=['full_attention', 'chunked_attention']), 'chunked_attention'),
    (lambda: _raw('llama', rope_parameters={'rope_type': 'proportional', 'rope_theta': 1e4}),
     r"rope_parameters\.rope_type='proportional'"),
    (lambda: _gemma_dict(rope_parameters={'full_attention': {'rope_type': 'proportional', 'rope_theta': 1e6},
                                          'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}),
     r"rope_parameters\.full_attention\.rope_type='proportional'"),
    (lambda: _gemma_dict(rope_parameters={'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
                                          'sliding_attention': {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4}}),
     r'rope_parameters\.sliding_attention'),
    (lambda: _raw('gemma3', architectures=['Gemma3ForConditionalGeneration'], text_config=_gemma_dict()),
     'Gemma3ForCausalLM'),
    (lambda: _raw('mistral', layer_types=['full_attention', 'sliding_attention']), 'layer_types'),
], ids=['final_softcap', 'attn_softcap', 'chunked_attention', 'unknown_rope_type', 'gemma_unknown_rope_type',
        'gemma_local_scaling', 'gemma3_multimodal', 'mistral_layer_types'])
def test_import_refusals_name_the_key(hf_config, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(hf_config(), BASE_MODEL)


def test_export_refusals_name_the_keys():
  partial_gemma = base_config.get_config().model
  partial_gemma.rmsnorm_unit_offset = True   # Gemma's (1 + w) norms without the rest of its block
  with pytest.raises(ValueError, match='rmsnorm_unit_offset.*HF Gemma 3 together'):
    hf.config_to_hf(partial_gemma)
  qwen3 = base_config.get_config().model
  qwen3.qk_norm = True                       # per-head q/k norms in Llama's block: Qwen3
  assert hf.config_to_hf(qwen3)['model_type'] == 'qwen3'
  mixed = flatron_config(sliding_window=4, layer_types=('full_attention', 'sliding_attention')).model
  with pytest.raises(ValueError, match='layer_types'):
    hf.config_to_hf(mixed)
  mixed.qkv_bias = True                      # ... which HF Qwen2 expresses
  out = hf.config_to_hf(mixed)
  assert out['model_type'] == 'qwen2' and out['layer_types'] == ['full_attention', 'sliding_attention']
  assert out['use_sliding_window'] and out['sliding_window'] == 4


def test_model_source_hf_copies_rope_scaling_and_gemma_keys(tmp_path):
  """from_files.apply_hf_model_config (model_source=hf) copies nested rope_scaling and the Gemma keys."""
  family_config('llama', rope_scaling=LLAMA3_ROPE).save_pretrained(tmp_path / 'llama')
  config = base_config.get_config()
  config.model.model_config = str(tmp_path / 'llama')
  from_files.apply_hf_model_config(config)
  r = config.model.rope_scaling
  assert (r.type, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == \
      ('llama3', 8.0, 1.0, 4.0, 32)

  family_config('gemma3_text', **GEMMA3).save_pretrained(tmp_path / 'gemma')
  config = base_config.get_config()
  config.model.model_config = str(tmp_path / 'gemma')
  from_files.apply_hf_model_config(config)
  m = config.model
  assert isinstance(m.layer_types, tuple) and m.layer_types == tuple(GEMMA3['layer_types'])
  assert (m.rope_theta, m.rope_local_theta, m.sliding_window, m.head_dim, m.query_pre_attn_scalar) == \
      (1e6, 1e4, 5, 32, 24)
  assert all(m[key] for key in hf.GEMMA_KEYS) and m.activation == 'geglu' and m.architecture == 'gemma3'
  assert m.rope_scaling.type == 'none' and m.share_embeddings_and_output_weights
