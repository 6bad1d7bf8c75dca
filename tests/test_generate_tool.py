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
  out = procs.run([sys.executable, 'tools/generate.py', *flags], timeout=120)
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
