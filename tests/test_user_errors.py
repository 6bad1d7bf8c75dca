"""Files a user brings, damaged as files get damaged, end in one line naming the file (exit 2,
no traceback, nothing written) in train.py and tools.convert; a MoE model trained with capacity
exports to HF dropless, saying so."""
import json
import os
import pathlib
import shutil
import sys

import pytest

from configs import llama_tiny
from model import hf, transformer
from tests import procs

TRAIN = [sys.executable, 'train.py', '--config=configs/llama_tiny.py:test', '--config.trainer.max_steps=4']
# What a user sees, as docs/failure-and-recovery.md quotes it (a test keeps the table true)
CUT_SHORT = 'not a readable safetensors file'
NOT_JSON = 'not valid JSON at line 1 column 3'
MODEL_CONFIG_IGNORED = 'is read only with model_source=hf'
NOT_YAML = 'not valid YAML at line 3 column 13: mapping values are not allowed in this context'
WORKDIR_FILE = 'is a file, not a directory; choose another --workdir'
DROPLESS = 'exported dropless'



@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp('hf')
  c = llama_tiny.get_config('test')
  hf.save_hf(str(path), c.model, transformer.init(c.model, 0))
  return path


def _one_line_error(argv, says, workdir=None):
  """Runs `argv`: exit 2, the error (one line; a config's problems one line each) saying `says`,
  no traceback, and the workdir left as it was (none)."""
  out = procs.run(argv, timeout=240)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  start = max(i for i, line in enumerate(lines) if line.startswith('error: '))
  last = ' '.join(lines[start:])
  assert says in last and all(line.startswith('  - ') for line in lines[start + 1:]), out.stderr[-2000:]
  assert 'Traceback' not in out.stderr
  if workdir is not None:
    assert not os.path.exists(workdir) or not os.listdir(workdir), os.listdir(workdir)
  return last


def test_a_safetensors_file_cut_short_given_to_init_from(hf_dir, tmp_path):
  cut = tmp_path / 'cut'
  os.makedirs(cut)
  for name in os.listdir(hf_dir):
    data = (hf_dir / name).read_bytes()
    (cut / name).write_bytes(data[:len(data) // 2] if name.endswith('.safetensors') else data)
  _one_line_error(TRAIN + [f'--workdir={tmp_path / "run"}', f'--config.exp_manager.init_from={cut}'],
                  f'{cut / "model.safetensors"}: {CUT_SHORT}', tmp_path / 'run')


def test_a_config_json_that_is_not_json_names_its_path_line_and_column(hf_dir, tmp_path):
  bad = tmp_path / 'config.json'
  bad.write_text((hf_dir / 'config.json').read_text().replace('{', '{ oops', 1))
  _one_line_error(TRAIN + [f'--workdir={tmp_path / "run"}', '--config.model_source=hf', f'--config.model.model_config={bad}'],
                  f'{bad}: {NOT_JSON}', tmp_path / 'run')


def test_a_model_config_without_model_source_hf_is_refused_not_ignored(hf_dir, tmp_path):
  _one_line_error(TRAIN + [f'--workdir={tmp_path / "run"}', f'--config.model.model_config={hf_dir / "config.json"}'],
                  MODEL_CONFIG_IGNORED, tmp_path / 'run')


def test_a_yaml_that_does_not_parse_names_its_line_and_column(tmp_path):
  bad = tmp_path / 'bad.yaml'
  bad.write_text('trainer:\n  max_steps: 3\n  devices: a: b\n')
  _one_line_error([sys.executable, 'train.py', f'--config=configs/nxd_yaml.py:{bad}', f'--workdir={tmp_path / "run"}'],
                  'bad.yaml: ' + NOT_YAML, tmp_path / 'run')


def test_a_workdir_that_is_a_file(tmp_path):
  (tmp_path / 'file').write_text('mine')
  _one_line_error(TRAIN + [f'--workdir={tmp_path / "file"}'], WORKDIR_FILE)
  assert (tmp_path / 'file').read_text() == 'mine'


def test_a_mixtral_trained_with_capacity_exports_to_hf_dropless_and_says_so(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  from configs import mixtral_tiny  # pylint: disable=import-outside-toplevel
  c = mixtral_tiny.get_config('test')
  c.trainer.max_steps, c.exp_manager.create_checkpoint_callback = 4, True
  c.exp_manager.create_tensorboard_logger = False
  assert not c.model.moe.dropless
  train.run(c, str(tmp_path / 'run'))
  out = procs.run([sys.executable, '-m', 'tools.convert', 'flatron-to-hf', f'--src={tmp_path / "run" / "checkpoints"}',
                   f'--dst={tmp_path / "hf"}'], timeout=240)
  assert out.returncode == 0 and DROPLESS in out.stdout, out.stderr[-2000:]
  assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['model_type'] == 'mixtral'
  cfg, _ = hf.load_hf(str(tmp_path / 'hf'))
  assert cfg.moe.dropless and cfg.moe.num_experts == c.model.moe.num_experts



def test_the_failure_table_quotes_what_the_tests_see():
  from tests.test_checkpoint_manager import NO_SPACE  # pylint: disable=import-outside-toplevel
  from tests.test_nxd_files import MISSING_RANK  # pylint: disable=import-outside-toplevel
  with open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'failure-and-recovery.md'), encoding='utf-8') as f:
    table = f.read()
  for phrase in (CUT_SHORT, NOT_JSON, MODEL_CONFIG_IGNORED, NOT_YAML, WORKDIR_FILE, DROPLESS, NO_SPACE, MISSING_RANK):
    assert phrase in table, phrase


def _damage(path, how):
  data = path.read_bytes() if path.is_file() else b''
  if how == 'emptied':
    path.write_bytes(b'')
  elif how.startswith('cut at '):
    path.write_bytes(data[:int(how.split()[-1])])
  elif how == 'cut in half':
    path.write_bytes(data[:len(data) // 2])
  elif how == 'header byte flipped':
    path.write_bytes(data[:12] + bytes([data[12] ^ 0xFF]) + data[13:])
  elif how == 'a directory':
    path.unlink()
    path.mkdir()
  elif how.startswith('json '):                 # a key removed or a value of the wrong type
    doc = json.loads(data)
    key, _, value = how[5:].partition('=')
    if value:
      doc[key] = value
    else:
      del doc[key]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize('name, how', [
    ('model.safetensors', 'emptied'), ('model.safetensors', 'cut at 4'), ('model.safetensors', 'cut in half'),
    ('model.safetensors', 'header byte flipped'), ('model.safetensors', 'a directory'),
    ('config.json', 'emptied'), ('config.json', 'cut in half'), ('config.json', 'a directory'),
    ('config.json', 'json hidden_size=big'), ('config.json', 'json num_attention_heads'),
])
def test_a_damaged_hf_directory_given_to_convert_is_one_line_naming_it(hf_dir, tmp_path, capsys, name, how):
  from absl import flags  # pylint: disable=import-outside-toplevel
  from tools import convert  # pylint: disable=import-outside-toplevel
  src = tmp_path / 'src'
  shutil.copytree(hf_dir, src)
  _damage(src / name, how)
  if 'src' not in flags.FLAGS:
    convert.define_flags()
  flags.FLAGS(['convert', f'--src={src}', f'--dst={tmp_path / "dst"}'])
  try:
    with pytest.raises(SystemExit) as e:
      convert.main(['convert', 'hf-to-flatron'])
  finally:
    flags.FLAGS.unparse_flags()
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err.count('\n') == 0 and str(src) in err, err
  assert not os.path.exists(tmp_path / 'dst')


@pytest.mark.parametrize('how', ['cut in half', 'emptied', 'a directory'])
def test_a_damaged_tokenizer_json_is_one_line_naming_it(tmp_path, how):
  from data import errors, tokenizer  # pylint: disable=import-outside-toplevel
  from tests.test_chat import tokenizer_dir  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(tokenizer_dir(tmp_path / 'tok')) / 'tokenizer.json'
  _damage(path, how)
  with pytest.raises(errors.DataError, match=f'tokenizer: .*{path}') as e:
    tokenizer.HuggingFaceTokenizer(str(path))
  assert '\n' not in str(e.value)


def test_a_sentencepiece_model_cut_short_is_one_line_naming_it(tmp_path):
  from data import errors, tokenizer  # pylint: disable=import-outside-toplevel
  (tmp_path / 'text.txt').write_text('\n'.join(f'line {i} of some text, with words' for i in range(300)))
  model = pathlib.Path(tokenizer.train_sentencepiece([str(tmp_path / 'text.txt')], str(tmp_path / 'sp'), 300))
  _damage(model, 'cut in half')
  with pytest.raises(errors.DataError, match=f'{model}: not a SentencePiece model'):
    tokenizer.SentencePieceTokenizer(str(model))


@pytest.mark.parametrize('name, how', [('adapter_config.json', 'cut in half'), ('adapter_config.json', 'emptied'),
                                       ('adapter_model.safetensors', 'cut in half'),
                                       ('adapter_model.safetensors', 'header byte flipped')])
def test_a_damaged_peft_directory_is_one_line_naming_it(tmp_path, name, how):
  """A peft adapter directory (flatron's own export, as peft writes one), damaged."""
  from model import adapters, hf_files, lora  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  c.model.peft.lora_rank = 4
  params = transformer.init(c.model, 0)
  adapters.save_peft(str(tmp_path / 'peft'), c.model, params)
  _damage(tmp_path / 'peft' / name, how)
  names = lora.trainable(c.model, params)
  with pytest.raises(hf_files.HFFileError, match=str(tmp_path / 'peft' / name)) as e:
    adapters.read_settings(str(tmp_path / 'peft'))
    adapters.read_boxes(str(tmp_path / 'peft'), {n: tuple(slice(0, k) for k in params[n].shape) for n in names})
  assert '\n' not in str(e.value)
