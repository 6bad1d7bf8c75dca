"""The public Python API docs/hf-models.md lists ("Python API"), one test per entry, each called
exactly as documented: a forking researcher's scripts must not break silently."""
import os
import shutil

import pytest
import torch

from checkpoint import state as states
from model import adapters, generation, hf, lora, param_table, transformer
from tools import convert, generate

os.environ.setdefault('HF_HUB_OFFLINE', '1')
transformers = pytest.importorskip('transformers')
IDS = torch.tensor([[5, 77, 12, 200, 3, 41, 9, 150]])


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('hf'))
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      vocab_size=300)).float().eval()
  model.save_pretrained(path)
  return path, model


def test_load_hf_and_forward_equal_transformers(hf_dir):
  path, model = hf_dir
  model_cfg, params = hf.load_hf(path)                         # load_hf(dir) -> (model config, params)
  logits = transformer.forward(params, IDS, model_cfg)         # forward(params, tokens_bs, model_cfg)
  with torch.no_grad():
    expected = model(IDS).logits
  assert logits.shape[:2] == IDS.shape and model_cfg.vocab_size == 300
  assert (logits[..., :300] - expected).abs().max().item() < 1e-5


def test_save_hf_writes_what_transformers_loads(hf_dir, tmp_path):
  path, model = hf_dir
  model_cfg, params = hf.load_hf(path)
  hf.save_hf(str(tmp_path / 'out'), model_cfg, params)         # save_hf(dir, model_cfg, params)
  again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'out')).eval()
  with torch.no_grad():
    assert torch.equal(again(IDS).logits, model(IDS).logits)


def test_generate_equals_transformers_greedy(hf_dir):
  path, model = hf_dir
  model_cfg, params = hf.load_hf(path)
  ours = generation.generate(params, model_cfg, IDS[0].tolist(), 6)   # generate(params, cfg, prompt_ids, n)
  with torch.no_grad():
    theirs = model.generate(IDS, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, IDS.shape[1]:]
  assert ours == theirs.tolist()


def test_convert_and_read_model_round_trip(hf_dir, tmp_path):
  path, _ = hf_dir
  step = convert.hf_to_flatron(path, str(tmp_path / 'ckpt'))   # hf_to_flatron(src, dst) -> step path
  config, params = states.read_model(step)                      # read_model(step or dir) -> (config, params)
  _, expected = hf.load_hf(path)
  assert params.keys() == expected.keys() and all(torch.equal(params[n], expected[n]) for n in params)
  convert.flatron_to_hf(step, str(tmp_path / 'back'))           # flatron_to_hf(step, dst)
  assert hf.load_hf(str(tmp_path / 'back'))[0].hidden_size == config.model.hidden_size == 32


def test_peft_adapters_save_load_and_merge(hf_dir, tmp_path):
  path, _ = hf_dir
  model_cfg, params = hf.load_hf(path)
  model_cfg.peft.update(dict(lora_rank=2, lora_alpha=4.0, target_modules=('q_proj', 'v_proj')))
  specs = param_table.param_specs(model_cfg)
  g = torch.Generator().manual_seed(0)
  params = dict(params, **{n: torch.randn(specs[n].shape, generator=g) * 0.1 for n in specs if lora.is_adapter(n)})
  adapters.save_peft(str(tmp_path / 'adapter'), model_cfg, params)          # save_peft(dir, model_cfg, params)
  cfg2, params2 = adapters.load_peft(str(tmp_path / 'adapter'), *hf.load_hf(path))   # load_peft(dir, cfg, params)
  convert.merge_peft(str(tmp_path / 'adapter'), path, str(tmp_path / 'merged'))      # merge_peft(adapter, base, dst)
  _, merged = hf.load_hf(str(tmp_path / 'merged'))
  with torch.no_grad():
    want = transformer.forward(params, IDS, model_cfg)
    assert (transformer.forward(params2, IDS, cfg2) - want).abs().max().item() < 1e-6
    assert (transformer.forward(merged, IDS, hf.load_hf(path)[0]) - want).abs().max().item() < 1e-5


def test_generate_tool_reply(hf_dir, tmp_path):
  path = shutil.copytree(hf_dir[0], str(tmp_path / 'model'))
  from data import tokenizer as tokenizers  # pylint: disable=import-outside-toplevel
  text = tmp_path / 'a.txt'
  text.write_text('the quick brown fox jumps over the lazy dog\n' * 40)
  tok_cfg = {'type': 'sentencepiece', 'model': tokenizers.train_sentencepiece([str(text)], str(tmp_path / 'sp'), 300)}
  model_cfg, params = hf.load_hf(path)
  convert.carry_tokenizer(path, None, tok_cfg)
  out = generate.reply(path, prompt='the quick', max_new_tokens=5)  # reply(model dir or step, prompt=...) -> text
  tok = tokenizers.from_directory(path)
  ids = [tok.bos_id] + tok.encode('the quick')
  new = generation.generate(params, model_cfg, ids, 5, stop_ids={tok.eos_id})
  assert out == tok.decode([t for t in new if t != tok.eos_id])
