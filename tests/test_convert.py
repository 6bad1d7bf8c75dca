"""tools/convert.py: HF -> flatron checkpoint -> HF is bit-exact, and the checkpoint trains; NxD
checkpoints both ways at another layout, bit-exact, with their step; bad input exits 2, writing nothing."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpoint import nxd_write
from configs import llama_tiny
from model import hf, transformer
from tests import procs
from tools import convert


def test_round_trip_is_bit_exact_and_loadable_by_init_from(tmp_path):
  c = llama_tiny.get_config('test')
  c.model.vocab_size = 300                      # padded to 384 in memory, 300 rows on disk
  params = transformer.init(c.model, 3)
  hf.save_hf(str(tmp_path / 'hf'), c.model, params)
  step = convert.hf_to_flatron(str(tmp_path / 'hf'), str(tmp_path / 'ckpt'))
  assert os.path.basename(step) == 'step_00000000'
  convert.flatron_to_hf(step, str(tmp_path / 'back'))
  before = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  after = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert before.keys() == after.keys()
  for name in before:
    assert torch.equal(before[name], after[name]), name
  assert before['model.embed_tokens.weight'].shape[0] == 300
  # and a run initialized from the converted step starts from exactly those weights
  import train  # pylint: disable=import-outside-toplevel
  c.trainer.max_steps, c.trainer.val_check_interval = 1, 0
  c.model.optim.sched.warmup_steps = 0         # a warm-up needs steps after it
  c.exp_manager.create_tensorboard_logger = False
  c.exp_manager.init_from = step
  c.model.optim.lr, c.trainer.gradient_clip_val = 1e-12, 0.0
  _, trained = train.run(c, str(tmp_path / 'run'))
  for name, value in params.items():
    torch.testing.assert_close(trained[name].detach()[:300], value.detach()[:300], atol=1e-6, rtol=0)


# --- exports are self-contained HF directories --------------------------------------------

EOS_TEXT = 'a b c d e f g h'


def test_the_command_line_takes_the_subcommand_first_and_names_a_wrong_one(tmp_path, capsys):
  c = llama_tiny.get_config('test')
  hf.save_hf(str(tmp_path / 'hf'), c.model, transformer.init(c.model, 3))
  cli = [sys.executable, '-m', 'tools.convert']
  done = procs.run(cli + ['hf-to-flatron', f'--src={tmp_path / "hf"}', '--dst', str(tmp_path / 'ckpt')], timeout=120)
  assert done.returncode == 0 and done.stdout == f'{tmp_path / "ckpt" / "step_00000000"}\n', done.stderr
  done = procs.run(cli + ['hf-to-peft', '--src=a', '--dst=b'], timeout=120)
  assert done.returncode == 2 and done.stderr == ("error: unknown subcommand 'hf-to-peft'; the subcommands are "
                                                  'hf-to-flatron, flatron-to-hf, export-peft, merge-peft, '
                                                  'nxd-to-hf, nxd-to-flatron, flatron-to-nxd\n')
  for argv, base, says in (([], None, 'name a subcommand'), (['export-peft', 'x'], None, 'unexpected arguments x'),
                           (['merge-peft'], None, 'merge-peft needs --base'),
                           (['export-peft'], 'b', '--base is for merge-peft only')):
    with pytest.raises(SystemExit) as e:
      convert.check_command_line(['convert', *argv], 'src', 'dst', base)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith('error: ') and err.count('\n') == 1 and says in err, err


def _source_model(path):
  """An HF directory as transformers writes one: a tiny Llama that always says end-of-text (one
  residual feature dominates, and only the EOS row reads it), its word-level tokenizer (<s>,
  </s>), special token ids and generation_config.json."""
  transformers = pytest.importorskip('transformers')
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {w: i for i, w in enumerate(['<unk>', '<s>', '</s>'] + EOS_TEXT.split() + [f'w{i}' for i in range(53)])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token='<s>', eos_token='</s>',
                                              unk_token='<unk>')
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      vocab_size=len(vocab), bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False))
  with torch.no_grad():
    model.model.embed_tokens.weight[:, 0] = 100.0
    model.lm_head.weight[2] = 0.0
    model.lm_head.weight[2, 0] = 3.0
  model.save_pretrained(path)
  fast.save_pretrained(path)
  return transformers


def _greedy(transformers, path, text='a b'):
  model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  tok = transformers.AutoTokenizer.from_pretrained(path)
  ids = tok(text, return_tensors='pt').input_ids
  with torch.no_grad():
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
  return out[0, ids.shape[1]:].tolist(), tok.eos_token_id


def test_exports_carry_tokenizer_token_ids_and_generation_config(tmp_path):
  transformers = _source_model(str(tmp_path / 'source'))
  expected, eos = _greedy(transformers, str(tmp_path / 'source'))
  assert expected[-1] == eos and len(expected) < 40        # the source model stops at EOS
  step = convert.hf_to_flatron(str(tmp_path / 'source'), str(tmp_path / 'ckpt'))
  convert.flatron_to_hf(step, str(tmp_path / 'export'))
  peft = pytest.importorskip('peft')
  peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'source')),
                      peft.LoraConfig(r=2, target_modules=['q_proj'])).save_pretrained(str(tmp_path / 'adapter'))
  convert.merge_peft(str(tmp_path / 'adapter'), str(tmp_path / 'source'), str(tmp_path / 'merged'))
  for name in ('export', 'merged'):
    out, export_eos = _greedy(transformers, str(tmp_path / name))
    assert (out, export_eos) == (expected, eos), name        # stops at EOS like the source model
    config = json.load(open(tmp_path / name / 'config.json'))
    assert (config['bos_token_id'], config['eos_token_id']) == (1, 2), name
    assert json.load(open(tmp_path / name / 'generation_config.json'))['eos_token_id'] == 2
  from tools import generate  # pylint: disable=import-outside-toplevel
  assert generate.reply(str(tmp_path / 'export'), prompt='a b', max_new_tokens=40) == \
      generate.reply(str(tmp_path / 'source'), prompt='a b', max_new_tokens=40)    # no --tokenizer needed


@pytest.mark.parametrize('kind', ['sentencepiece', 'gpt2'])
def test_an_export_carries_the_run_tokenizer_when_there_is_no_source_model(kind, tmp_path):
  """A model trained from scratch: the export holds the run's tokenizer as AutoTokenizer reads
  it, with its ids in config.json and generation_config.json."""
  transformers = pytest.importorskip('transformers')
  from data import tokenizer as tokenizers  # pylint: disable=import-outside-toplevel
  text = tmp_path / 'a.txt'
  text.write_text('To be, or not to be, that is the question.\n' * 50 + 'Whether tis nobler in the mind.\n' * 50)
  if kind == 'sentencepiece':
    tok_cfg = {'type': 'sentencepiece', 'model': tokenizers.train_sentencepiece([str(text)], str(tmp_path / 'sp'), 300)}
  else:
    from tokenizers import pre_tokenizers  # pylint: disable=import-outside-toplevel
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet()) + ['To', 'be', '<|endoftext|>']
    (tmp_path / 'vocab.json').write_text(json.dumps({t: i for i, t in enumerate(symbols)}))
    (tmp_path / 'merges.txt').write_text('#version: 0.2\nT o\nb e\n')
    tok_cfg = {'type': 'gpt2', 'vocab_file': str(tmp_path / 'vocab.json'), 'merge_file': str(tmp_path / 'merges.txt')}
  ours = tokenizers.load_tokenizer(tok_cfg)
  c = llama_tiny.get_config('test')
  c.model.vocab_size = max(256, ours.vocab_size)
  hf.save_hf(str(tmp_path / 'hf'), c.model, transformer.init(c.model, 3))
  convert.carry_tokenizer(str(tmp_path / 'hf'), None, tok_cfg)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  sample = 'To be, or not to be'
  assert theirs(sample, add_special_tokens=False).input_ids == ours.encode(sample)
  assert theirs.eos_token_id == ours.eos_id
  assert json.load(open(tmp_path / 'hf' / 'config.json'))['eos_token_id'] == ours.eos_id
  assert json.load(open(tmp_path / 'hf' / 'generation_config.json'))['eos_token_id'] == ours.eos_id


def test_nxd_converter_output_converts_as_it_is(tmp_path):
  """NxD's checkpoint_converter.py --output_dir DIR writes DIR/model/ rank files only (no tag, no
  `done`): --src=DIR reads it, bit-exact."""
  c = llama_tiny.get_config('test')
  params = transformer.init(c.model, 3)
  hf.save_hf(str(tmp_path / 'hf'), c.model, params)
  os.makedirs(tmp_path / 'pretrained_ckpt' / 'model')
  for (_, r, s), state in nxd_write.split(params, c.model, 2, 2).items():
    torch.save(state, tmp_path / 'pretrained_ckpt' / 'model' / f'dp_rank_00_tp_rank_{r:02d}_pp_rank_{s:02d}.pt')
  done = procs.run([sys.executable, '-m', 'tools.convert', 'nxd-to-hf', f'--src={tmp_path / "pretrained_ckpt"}',
                    f'--model_config={tmp_path / "hf" / "config.json"}', f'--dst={tmp_path / "back"}'], timeout=120)
  assert done.returncode == 0, done.stderr
  before, after = load_file(str(tmp_path / 'hf' / 'model.safetensors')), load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_nxd_checkpoints_convert_both_ways_at_any_layout(tmp_path):
  c = llama_tiny.get_config('test')
  c.model.vocab_size, c.model.num_attention_heads, c.model.num_kv_heads = 300, 4, 2
  params = transformer.init(c.model, 3)
  hf.save_hf(str(tmp_path / 'hf'), c.model, params)
  step = convert.hf_to_flatron(str(tmp_path / 'hf'), str(tmp_path / 'ckpt'))
  cli = [sys.executable, '-m', 'tools.convert']
  done = procs.run(cli + ['flatron-to-nxd', f'--src={step}', f'--dst={tmp_path / "nxd"}', '--tp=4', '--pp=2',
                          '--kv_replicator=2', '--hw=trn2'], timeout=120)
  assert done.returncode == 0, done.stderr
  tag = done.stdout.strip()
  assert tag.endswith('--step=0-consumed_samples=0.0.ckpt') and os.path.exists(os.path.join(tag, 'done'))
  assert len(os.listdir(os.path.join(tag, 'model'))) == 8          # tp 4 x pp 2 rank files
  config_json = str(tmp_path / 'hf' / 'config.json')
  done = procs.run(cli + ['nxd-to-hf', f'--src={tmp_path / "nxd"}', f'--model_config={config_json}',
                          f'--dst={tmp_path / "back"}', '--hw=trn2'], timeout=120)
  assert done.returncode == 0, done.stderr
  before, after = load_file(str(tmp_path / 'hf' / 'model.safetensors')), load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
  flat = convert.nxd_to_flatron(tag, str(tmp_path / 'flat'), config_json, 'trn2')
  assert 'step_00000000' in flat and 'optimizer state not carried' in flat
  for argv, says in ((['nxd-to-hf', f'--src={tag}', f'--dst={tmp_path / "x"}'], 'needs --model_config'),
                     (['nxd-to-hf', f'--src={tag}', f'--model_config={config_json}', f'--dst={tmp_path / "x"}',
                       '--hw=trn1'], 'pass hw=trn2')):
    done = procs.run(cli + argv, timeout=120)
    assert done.returncode == 2 and says in done.stderr and done.stderr.count('\n') == 1, done.stderr
    assert not os.path.exists(tmp_path / 'x')

