"""user_errors.py, and what it is for: every file a user brings, damaged as files get damaged,
ends in one line naming the file (exit 2, no traceback, nothing written) in train.py and every
tool; faults mid-run (a full, read-only or removed disk) keep the last committed step; a MoE
model trained with capacity exports to HF dropless, saying so."""
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
NO_SPACE_KEPT = 'this step is not committed and the last committed step is kept'



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


# --- user_errors.py: the one way every entry point reports them

def test_an_os_error_is_one_line_naming_its_path_and_the_fix(tmp_path, capsys, monkeypatch):
  import errno  # pylint: disable=import-outside-toplevel
  import user_errors  # pylint: disable=import-outside-toplevel
  said = user_errors.describe(PermissionError(errno.EACCES, 'Permission denied', str(tmp_path / 'f')))
  assert said == f'{tmp_path / "f"}: permission denied; check its permissions'

  def fails():
    open(tmp_path, encoding='utf-8')          # a directory where a file should be

  with pytest.raises(SystemExit) as e:
    user_errors.exit_on_error(fails)
  assert e.value.code == 2 and capsys.readouterr().err == (
      f'error: {tmp_path}: is a directory; point it at the file, not the directory\n')
  monkeypatch.setenv('FLATRON_DEBUG', '1')       # the traceback, for a bug report
  with pytest.raises(IsADirectoryError):
    user_errors.exit_on_error(fails)


# --- every kind of file a user brings, damaged as files get damaged, through the entry points
# that read it: exit 2, one error line naming the file (a config's problems one per line below
# it), no traceback, nothing written. Each entry point is called as its main calls it (the
# tools' flags are parsed in the subprocess tests above and in each tool's own tests).

DAMAGES = ('emptied', 'cut at 4', 'cut in half', 'bytes flipped', 'a directory', 'removed')


def _damage_all(path, how):
  if how == 'removed':
    path.unlink()
  elif how == 'bytes flipped':          # several bytes, from a third of the way in
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data), max(len(data) // 7, 1)):
      data[i] ^= 0xA5
    path.write_bytes(bytes(data))
  else:
    _damage(path, how)


def _refused(capsys, fn, *args, names, also=(ValueError,)):
  import user_errors  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as e:
    user_errors.exit_on_error(fn, *args, also=also)
  lines = capsys.readouterr().err.strip().splitlines()
  lines = lines[max(i for i, line in enumerate(lines) if line.startswith('error: ')):]
  assert e.value.code == 2 and all(line.startswith('  - ') for line in lines[1:]), lines
  assert names in lines[0] and 'Traceback' not in '\n'.join(lines), lines


def _tokenizer_files(tmp_path):
  from tests.test_chat import tokenizer_dir  # pylint: disable=import-outside-toplevel
  directory = pathlib.Path(tokenizer_dir(tmp_path / 'tok'))
  (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': f'document {i}: some words'}) + '\n'
                                             for i in range(20)))
  vocab = {'a': 0, 'b': 1, 'ab': 2, 'c': 3, '<|endoftext|>': 4}
  (tmp_path / 'vocab.json').write_text(json.dumps(vocab))
  (tmp_path / 'merges.txt').write_text('#version: 0.2\na b\n')
  return directory


# kind -> (the file damaged, relative to tmp_path; how the preprocess tokenizer is set)
PREPROCESS = {
    'JSON lines to tokenize': ('in.jsonl', {'type': 'huggingface', 'model': 'tok/tokenizer.json'}),
    'tokenizer.json': ('tok/tokenizer.json', {'type': 'huggingface', 'model': 'tok/tokenizer.json'}),
    'tokenizer_config.json': ('tok/tokenizer_config.json', {'type': 'huggingface', 'model': 'tok/tokenizer.json'}),
    'GPT-2 vocab.json': ('vocab.json', {'type': 'gpt2', 'vocab_file': 'vocab.json', 'merge_file': 'merges.txt'}),
    'GPT-2 merges.txt': ('merges.txt', {'type': 'gpt2', 'vocab_file': 'vocab.json', 'merge_file': 'merges.txt'}),
}
# damages a file survives as a valid file of its kind (no checksum to fail): the flip lands in text
SURVIVES = {('GPT-2 merges.txt', 'bytes flipped'), ('tokenizer_config.json', 'removed')}


@pytest.mark.parametrize('how', DAMAGES)
@pytest.mark.parametrize('kind', sorted(PREPROCESS))
def test_tools_preprocess_reads_damaged_inputs_and_tokenizers_in_one_line(tmp_path, capsys, kind, how):
  from tools import preprocess  # pylint: disable=import-outside-toplevel
  if (kind, how) in SURVIVES:
    pytest.skip('still a valid file of its kind')
  _tokenizer_files(tmp_path)
  name, tok = PREPROCESS[kind]
  tok = {k: str(tmp_path / v) if k != 'type' else v for k, v in tok.items()}
  _damage_all(tmp_path / name, how)
  _refused(capsys, preprocess.preprocess, [str(tmp_path / 'in.jsonl')], str(tmp_path / 'out' / 'ds'), tok,
           None, 'file', 1, True, True, names=str(tmp_path / name).removesuffix('/tokenizer_config.json'),
           also=())
  assert not os.path.exists(tmp_path / 'out') or not os.listdir(tmp_path / 'out')


@pytest.fixture(scope='module')
def flatron_step(tmp_path_factory):
  """A committed step of a tiny run."""
  import train  # pylint: disable=import-outside-toplevel
  path = tmp_path_factory.mktemp('run')
  c = llama_tiny.get_config('test')
  c.trainer.max_steps, c.exp_manager.create_checkpoint_callback = 4, True
  c.exp_manager.create_tensorboard_logger = False
  train.run(c, str(path))
  return next((path / 'checkpoints').glob('step_*'))


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


def _index_file(step):
  """The array index OCDBT reads first (the root database's only data file)."""
  return next((step / 'arrays' / 'd').iterdir()).relative_to(step)


# kind -> (where the good copy comes from, the file damaged in it, the entry point's read)
def _hf_read(path, tmp_path):
  from tools import generate  # pylint: disable=import-outside-toplevel
  generate.load_model(str(path))


def _peft_read(path, tmp_path):
  from model import adapters  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  adapters.load_peft(str(path), c.model, transformer.init(c.model, 0))


def _step_to_hf(path, tmp_path):
  from tools import convert  # pylint: disable=import-outside-toplevel
  convert.flatron_to_hf(str(path), str(tmp_path / 'dst'))


def _sft_read(path, tmp_path):
  from tools import sft_eval  # pylint: disable=import-outside-toplevel
  sft_eval.read_examples(str(path))


def _yaml_read(path, tmp_path):
  from configs import nxd_yaml  # pylint: disable=import-outside-toplevel
  from tools import plan  # pylint: disable=import-outside-toplevel
  plan.resolve(nxd_yaml.get_config(str(path)))


@pytest.fixture
def sources(hf_dir, flatron_step, tmp_path):
  c = llama_tiny.get_config('test')
  c.model.peft.lora_rank = 4
  from model import adapters  # pylint: disable=import-outside-toplevel
  adapters.save_peft(str(tmp_path / 'peft_src'), c.model, transformer.init(c.model, 0))
  (tmp_path / 'sft.jsonl').write_text(''.join(json.dumps({'input': f'question {i}', 'output': f'answer {i}'}) + '\n'
                                              for i in range(12)))
  shutil.copy(os.path.join('tests', 'fixtures', 'nxd_yaml', 'hf_llama3_8B_config.yaml'), tmp_path / 'nxd.yaml')
  return {'hf': hf_dir, 'peft': tmp_path / 'peft_src', 'step': flatron_step, 'sft': tmp_path / 'sft.jsonl',
          'yaml': tmp_path / 'nxd.yaml'}


READS = {    # kind: (source, file in it ('' = the file itself), the read (as the entry point's main calls it))
    'HF config.json (tools.generate)': ('hf', 'config.json', _hf_read),
    'HF model.safetensors (tools.generate)': ('hf', 'model.safetensors', _hf_read),
    'peft adapter_config.json (tools.generate --adapter)': ('peft', 'adapter_config.json', _peft_read),
    'peft adapter_model.safetensors (tools.generate --adapter)': ('peft', 'adapter_model.safetensors', _peft_read),
    'flatron step metadata.json (tools.convert)': ('step', 'metadata.json', _step_to_hf),
    'flatron step array index (tools.convert)': ('step', None, _step_to_hf),
    'SFT records (tools.sft_eval)': ('sft', '', _sft_read),
    'NxD YAML (tools.plan)': ('yaml', '', _yaml_read),
}
STILL_VALID = {('SFT records (tools.sft_eval)', 'cut in half'),   # cut at a line end: fewer records, all whole
               # safetensors keeps no checksum: flipped bits in tensor data read as other numbers (as in transformers)
               ('HF model.safetensors (tools.generate)', 'bytes flipped'),
               ('peft adapter_model.safetensors (tools.generate --adapter)', 'bytes flipped')}


@pytest.mark.parametrize('how', DAMAGES)
@pytest.mark.parametrize('kind', sorted(READS))
def test_damaged_models_adapters_steps_records_and_yaml_are_one_line(sources, tmp_path, capsys, kind, how):
  source, name, read = READS[kind]
  if (kind, how) in STILL_VALID:
    pytest.skip('still a valid file of its kind')
  src = sources[source]
  if src.is_dir():
    path = _copy(src, tmp_path / 'damaged')
    target = path / (name if name is not None else _index_file(src))
  else:
    path = target = tmp_path / ('damaged' + src.suffix)
    shutil.copy(src, path)
  _damage_all(target, how)
  _refused(capsys, read, path, tmp_path, names=str(path))
  assert not os.path.exists(tmp_path / 'dst')


TRAIN_READS = {    # kind: (file damaged; how the run is pointed at it)
    'Megatron .idx (train.py)': ('corpus.idx', 'data'),
    'Megatron .bin (train.py)': ('corpus.bin', 'data'),
    'flatron step metadata.json (train.py init_from)': ('step/metadata.json', 'init_from'),
    'flatron step array index (train.py init_from)': ('step/index', 'init_from'),
}


@pytest.mark.parametrize('how', DAMAGES)
@pytest.mark.parametrize('kind', sorted(TRAIN_READS))
def test_train_py_reads_damaged_data_and_steps_in_one_line_leaving_no_workdir(flatron_step, tmp_path, capsys, kind, how):
  import numpy as np  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  from data import indexed  # pylint: disable=import-outside-toplevel
  name, how_used = TRAIN_READS[kind]
  c = llama_tiny.get_config('test')
  c.exp_manager.create_tensorboard_logger = False
  if how_used == 'data':
    indexed.write(str(tmp_path / 'corpus'), [np.arange(i % 50, i % 50 + 40, dtype=np.int32) for i in range(64)])
    c.data.data_prefix, c.data.splits_string = (str(tmp_path / 'corpus'),), '100,0,0'
    target = tmp_path / name
  else:
    step = _copy(flatron_step, tmp_path / 'step')
    c.exp_manager.init_from = str(step)
    target = step / (_index_file(step) if name.endswith('index') else 'metadata.json')
  _damage_all(target, how)
  _refused(capsys, train.run, c, str(tmp_path / 'run'), names=str(tmp_path / ('step' if how_used == 'init_from' else
                                                                               'corpus')), also=())
  assert not os.path.exists(tmp_path / 'run') or not os.listdir(tmp_path / 'run')


@pytest.fixture
def readable(hf_dir, tmp_path):
  """The inputs of the permission tests."""
  from tests.test_chat import tokenizer_dir  # pylint: disable=import-outside-toplevel
  tokenizer_dir(tmp_path / 'tok')
  (tmp_path / 'in.jsonl').write_text(json.dumps({'text': 'some words'}) + '\n')
  shutil.copytree(hf_dir, tmp_path / 'hf')
  (tmp_path / 'c.yaml').write_text('model:\n  num_layers: 2\n')
  return tmp_path


def _permissions_apply():
  """In the child: file permissions apply even to root (it loses CAP_DAC_OVERRIDE and
  CAP_DAC_READ_SEARCH; an unprivileged user has neither anyway)."""
  import ctypes  # pylint: disable=import-outside-toplevel
  if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
      if libc.prctl(24, capability, 0, 0, 0) != 0:      # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), 'prctl(PR_CAPBSET_DROP) failed')


PERMISSION = {    # entry point: (the file made unreadable, its command line)
    'tools.preprocess input': ('in.jsonl', ['-m', 'tools.preprocess', '--input={d}/in.jsonl', '--output-prefix={d}/out',
                                            '--tokenizer-type=huggingface', '--tokenizer-model={d}/tok/tokenizer.json']),
    'tools.preprocess tokenizer.json': ('tok/tokenizer.json', ['-m', 'tools.preprocess', '--input={d}/in.jsonl',
                                                               '--output-prefix={d}/out', '--tokenizer-type=huggingface',
                                                               '--tokenizer-model={d}/tok/tokenizer.json']),
    'tools.generate model.safetensors': ('hf/model.safetensors', ['-m', 'tools.generate', '--model={d}/hf',
                                                                  '--prompt=hi', '--max_new_tokens=2']),
    'train.py NxD YAML': ('c.yaml', ['train.py', '--config=configs/nxd_yaml.py:{d}/c.yaml', '--workdir={d}/run']),
}


@pytest.mark.parametrize('entry', sorted(PERMISSION))
def test_a_file_the_user_may_not_read_is_one_line_naming_it(readable, entry):
  name, argv = PERMISSION[entry]
  (readable / name).chmod(0)
  out = procs.run([sys.executable] + [a.format(d=readable) for a in argv], timeout=240, preexec_fn=_permissions_apply)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  assert lines[-1].startswith('error: ') and lines[-1].endswith(f'{readable / name}: permission denied; check its permissions'), lines[-3:]
  assert not (readable / 'run').exists() and not list(readable.glob('out*'))


@pytest.mark.parametrize('read', [_hf_read, _peft_read, _step_to_hf], ids=['HF model', 'peft adapter', 'flatron step'])
def test_a_file_where_a_directory_should_be_is_one_line_naming_it(tmp_path, capsys, read):
  (tmp_path / 'model').write_text('not a directory')
  _refused(capsys, read, tmp_path / 'model', tmp_path, names=str(tmp_path / 'model'))
  assert not os.path.exists(tmp_path / 'dst')


# --- faults mid-run

def _tiny_run(max_steps, resume=False):
  c = llama_tiny.get_config('test')
  c.trainer.max_steps, c.exp_manager.create_checkpoint_callback = max_steps, True
  c.exp_manager.checkpoint_callback_params.every_n_train_steps = 2
  c.exp_manager.create_tensorboard_logger, c.exp_manager.resume_if_exists = False, resume
  return c


def _at_second_save(monkeypatch, fault):
  from checkpoint import manager  # pylint: disable=import-outside-toplevel
  save, saves = manager.CheckpointManager.save, []

  def faulty(self, step, *args, **kwargs):
    saves.append(step)
    if len(saves) == 2:
      fault()
    return save(self, step, *args, **kwargs)
  monkeypatch.setattr(manager.CheckpointManager, 'save', faulty)


def test_a_workdir_removed_mid_run_is_written_anew_and_the_next_run_resumes(tmp_path, monkeypatch, capsys):
  import train  # pylint: disable=import-outside-toplevel
  run = tmp_path / 'run'
  _at_second_save(monkeypatch, lambda: shutil.rmtree(run))
  train.run(_tiny_run(8), str(run))
  assert 'metrics.jsonl was removed during the run; writing it anew' in capsys.readouterr().err
  monkeypatch.undo()
  record, _ = train.run(_tiny_run(10, resume=True), str(run))
  records = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records if 'loss' in r] == list(range(5, 11)) and record['step'] == 10 and sorted(os.listdir(run / 'checkpoints'))[-1] == \
      'step_00000010'


def test_a_checkpoint_directory_made_read_only_mid_run_ends_in_one_line_keeping_the_last_commit(tmp_path, monkeypatch,
                                                                                                capsys):
  import errno  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  from checkpoint import store  # pylint: disable=import-outside-toplevel

  def read_only():
    def refuse(*args, **kwargs):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(store, 'write_local', refuse)
  _at_second_save(monkeypatch, read_only)
  _refused(capsys, train.run, _tiny_run(8), str(tmp_path / 'run'), also=(),
           names=f'a read-only file system at {tmp_path / "run" / "checkpoints" / "step_00000004"}: ' + NO_SPACE_KEPT)
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['step_00000002']
  record, _ = train.run(_tiny_run(4, resume=True), str(tmp_path / 'run'))
  assert record['step'] == 4


def test_the_damaged_files_table_lists_every_kind_tested():
  with open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'failure-and-recovery.md'), encoding='utf-8') as f:
    rows = [line for line in f.read().split('## Damaged files')[1].splitlines() if line.startswith('| ')]
  named = {row.split(' | ')[0][2:].split(' (')[0] for row in rows}
  kinds = {kind.split(' (')[0] for kind in (*PREPROCESS, *READS, *TRAIN_READS)}
  assert kinds <= named, sorted(kinds - named)


def test_a_long_message_keeps_its_start_and_its_cause():
  import user_errors  # pylint: disable=import-outside-toplevel
  long = 'Error writing "a": ' + 'x' * 1000 + ': No space left on device [source locations=\'a.cc:1\nb.cc:2\']'
  short = user_errors.shorten(long)
  assert len(short) <= 400 and short.startswith('Error writing "a": xxx') and short.endswith('No space left on device')
  assert ' ... ' in short and user_errors.shorten('short [source locations=\'x\']') == 'short'
