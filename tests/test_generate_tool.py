"""tools/generate.py end to end: a chat message through an HF directory's template, greedy,
equals transformers' generate; a checkpoint directory means its newest step; bad paths are
one line."""
import os
import sys

import pytest
import torch

from tests import procs
from tests.test_chat import SMOL, theirs, tokenizer_dir

transformers = pytest.importorskip('transformers')
MESSAGE = 'Hello! How are you today?'


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
  """A random HF Llama with the test tokenizer and SmolLM2's chat template beside it."""
  path = tokenizer_dir(tmp_path_factory.mktemp('model'))
  vocab = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, 'tokenizer.json')).vocab_size
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      vocab_size=vocab, max_position_embeddings=256)).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():          # peaked logits: a decisive greedy path
      p.copy_(torch.randn(p.shape) * (0.2 if 'norm' not in name else 0.1) + ('norm' in name))
  model.save_pretrained(path)
  return path, model


def generate(*flags):
  out = procs.run([sys.executable, '-m', 'tools.generate', *flags], timeout=120)
  return out.returncode, out.stdout.strip(), out.stderr.strip()


def test_chat_reply_equals_transformers_generate(model_dir):
  path, model = model_dir
  code, text, err = generate(f'--model={path}', f'--chat={MESSAGE}', '--max_new_tokens=8')
  assert code == 0, err
  tok = theirs(path, SMOL)
  ids = tok.apply_chat_template([{'role': 'user', 'content': MESSAGE}], add_generation_prompt=True, tokenize=True)
  ids = ids['input_ids'] if hasattr(ids, 'keys') else ids
  expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
  stop = tok.convert_tokens_to_ids('<|im_end|>')
  expected = [t for t in expected.tolist()[:8] if t != stop]
  assert len(expected) >= 4 and text == tok.decode(expected).strip()


def test_bad_model_path_is_one_line(tmp_path):
  code, _, err = generate(f'--model={tmp_path}', '--prompt=hi')
  assert code != 0 and err.splitlines()[-1].startswith('error:') and 'committed' in err


FAMILIES = {     # tiny random models of each imported family, windows shorter than the reply
    'mistral': (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=4)),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict()),
    'gemma3': (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        sliding_window=4, head_dim=32, query_pre_attn_scalar=32,
        layer_types=['sliding_attention', 'full_attention'])),
}


@pytest.mark.parametrize('family', FAMILIES)
def test_prompt_continuation_equals_transformers_for_each_family(family, tmp_path):
  """tools/generate.py's reply (prompt through the HF directory's tokenizer, greedy, KV cache
  with sliding windows) equals transformers' generate for every imported family."""
  from tools import generate as generate_tool  # pylint: disable=import-outside-toplevel
  config_class, model_class, overrides = FAMILIES[family]
  path = tokenizer_dir(str(tmp_path / family))
  tok = theirs(path, SMOL)
  torch.manual_seed(0)
  model = model_class(config_class(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=256,
                                   tie_word_embeddings=False, **overrides)).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():          # peaked logits: a decisive greedy path
      p.copy_(torch.randn(p.shape) * (0.2 if 'norm' not in name else 0.1) + ('norm' in name and family != 'gemma3'))
  model.save_pretrained(path)
  text = generate_tool.reply(path, prompt='Hello there, how', max_new_tokens=10)
  ids, _ = generate_tool.prompt_ids(generate_tool.load_tokenizer(path, None), path, 'Hello there, how')
  assert ids[1:] == tok('Hello there, how').input_ids      # the tool's prompt: BOS, then HF's ids
  expected = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None)[0, len(ids):]
  expected = expected.tolist()
  if tok.eos_token_id in expected:                     # the tool stops at end-of-sequence
    expected = expected[:expected.index(tok.eos_token_id)]
  assert len(expected) >= 3 and text == tok.decode(expected)
