"""configs/nxdt.py: NxD Training YAML -> flatron config, the report of keys not honoured,
the export back to YAML, and each example config's fixture training for a few steps."""
import json
import os
import sys

import pytest

from configs import base, from_files, llama3_8b, llama7b, llama_tiny, nxdt, smollm2_lora, smollm2_sft
from model import hf
from tests import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, 'tests', 'fixtures', 'nxdt')
# fixture -> (the hand-written config it mirrors, the config.json both read their architecture from)
MIRRORS = {
    'megatron_llama_7B_config.yaml': (llama7b, None),
    'hf_llama3_8B_config.yaml': (llama3_8b, 'llama3_8b_config.json'),
    'smollm2_SFT_config.yaml': (smollm2_sft, 'smollm2_135m_config.json'),
    'smollm2_SFT_lora_config.yaml': (smollm2_lora, 'smollm2_135m_config.json'),
}


def fixture(name):
  return os.path.join(FIXTURES, name)


def write_yaml(tmp_path, text, name='c.yaml'):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _with_architecture(config, config_json):
  """The model section as a run sees it: model_source=hf reads config.json at start-up."""
  if config_json:
    config.model.model_config = fixture(config_json)
    from_files.apply_hf_model_config(config)
    config.model_source, config.model.model_config_overrides = 'hf', ()
  return config.to_dict()


@pytest.mark.parametrize('name', sorted(MIRRORS))
def test_each_example_maps_to_the_hand_written_config(name):
  module, config_json = MIRRORS[name]
  mapped = nxdt.load(fixture(name))
  expected = module.get_config()
  if config_json:                              # the hand-written file is megatron-sourced for llama3_8b
    assert mapped.config.model_source == 'hf'
    assert set(mapped.config.model.model_config_overrides) >= {'num_layers', 'hidden_size', 'rope_theta'}
  assert _with_architecture(mapped.config, config_json) == _with_architecture(expected, config_json)


@pytest.mark.parametrize('name', sorted(MIRRORS))
def test_every_key_of_an_example_is_honoured_or_reported_with_its_reason(name):
  mapped = nxdt.load(fixture(name))
  reported = {key for key, _, _ in mapped.not_honoured}
  assert all(reason for _, _, reason in mapped.not_honoured)
  from configs import yaml_config  # pylint: disable=import-outside-toplevel
  keys = nxdt._flatten(yaml_config.read(fixture(name)))  # pylint: disable=protected-access
  for key in keys:
    target, note = nxdt.describe(key)
    assert (key in reported) == (target == '—' or note.startswith('read only with')
                                 or key == 'model.encoder_seq_length' and key in reported), key
  assert 'trainer.devices' in reported and 'exp_manager.save_xser' in reported


def test_the_sft_example_loads_weights_only_from_resume_from_checkpoint():
  c = nxdt.load(fixture('smollm2_SFT_config.yaml')).config
  assert c.exp_manager.init_from == '.data/models/smollm2-135m-instruct'
  assert c.exp_manager.resume_from_checkpoint is None
  assert c.data.tokenizer.model == '.data/models/smollm2-135m-instruct/tokenizer.json'


def test_unknown_keys_are_one_error_listing_all_with_did_you_mean(tmp_path):
  path = write_yaml(tmp_path, 'trainer:\n  max_stepz: 3\nmodel:\n  num_layer: 2\n  hidden_size: 64\nfoo: 1\n')
  with pytest.raises(ValueError) as e:
    nxdt.load(path)
  text = str(e.value)
  assert '3 key(s)' in text and 'foo' in text
  assert 'trainer.max_stepz (did you mean trainer.max_steps' in text
  assert 'model.num_layer (did you mean model.num_layers' in text


@pytest.mark.parametrize('text,message', [
    ('data:\n  dataloader_type: cyclic\n', "data.dataloader_type='cyclic'"),
    ('model:\n  transformer_block_type: post_ln\n', 'pre_ln'),
    ('trainer:\n  limit_val_batches: 0.5\n', 'give an int'),
    ('model:\n  activations_checkpoint_recompute: [Embedding]\n', 'CoreAttention'),
    ('data:\n  tokenizer:\n    library: tiktoken\n', 'huggingface, sentencepiece, megatron'),
    ('data:\n  data_prefix: {train: [1.0, /a]}\n', 'splits_string'),
    ('precision:\n  type: manual\n  xla_use_bf16: "1"\n  bogus: 1\n', 'precision.bogus'),
])
def test_values_flatron_cannot_honour_are_errors_naming_the_key(tmp_path, text, message):
  with pytest.raises(ValueError) as e:
    nxdt.load(write_yaml(tmp_path, text))
  assert message in str(e.value)


def test_precision_knobs_are_read_only_with_type_manual(tmp_path):
  knobs = '  master_weights: True\n  xla_use_bf16: "1"\n  neuron_rt_stochastic_rounding_en: "1"\n'
  manual = nxdt.load(write_yaml(tmp_path, 'precision:\n  type: manual\n' + knobs)).config.precision
  assert (manual.parameter_dtype, manual.master_weights, manual.stochastic_rounding) == ('bf16', True, True)
  mapped = nxdt.load(write_yaml(tmp_path, 'precision:\n  type: mixed_precision\n' + knobs, 'm.yaml'))
  assert mapped.config.precision.to_dict() == dict(base.get_config().precision.to_dict(), type='mixed_precision')
  assert {k for k, _, _ in mapped.not_honoured} == {'precision.master_weights', 'precision.xla_use_bf16',
                                                    'precision.neuron_rt_stochastic_rounding_en'}


@pytest.mark.parametrize('module', [llama_tiny, llama7b, llama3_8b, smollm2_sft, smollm2_lora])
def test_export_to_yaml_reads_back_to_the_same_config(tmp_path, module):
  config = module.get_config()
  path = write_yaml(tmp_path, nxdt.to_yaml(config))
  assert nxdt.load(path).config.to_dict() == config.to_dict()


def test_every_documented_key_is_honoured_or_not_applicable():
  known = nxdt._known(base.get_config())  # pylint: disable=protected-access
  for key in nxdt.DOCUMENTED:
    target, note = nxdt.describe(key)
    if target == '—':
      assert note.startswith('not applicable: ') and len(note) > 20, key
    else:
      assert target.split(' ')[0] in known, (key, target)


def test_the_readme_table_is_the_code_s():
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    assert nxdt.table() in f.read(), 'README.md is out of date: paste configs.nxdt.table()'


def _tiny_hf_dir(tmp_path):
  from tests.test_chat import tokenizer_dir  # pylint: disable=import-outside-toplevel
  from tests.test_sft import CHATS, write_jsonl  # pylint: disable=import-outside-toplevel
  config = llama_tiny.get_config().model
  config.vocab_size = 512
  (tmp_path / 'config.json').write_text(json.dumps(hf.config_to_hf(config)))
  tok = tokenizer_dir(tmp_path / 'tok')
  data = write_jsonl(tmp_path / 'chats.jsonl', CHATS * 8)
  return str(tmp_path / 'config.json'), tok, data


@pytest.mark.parametrize('name', sorted(MIRRORS))
def test_each_example_trains_a_few_steps_on_the_tiny_model(tmp_path, name):
  size = ['--config.trainer.max_steps=3', '--config.trainer.val_check_interval=0',
          '--config.trainer.num_sanity_val_steps=0', '--config.model.optim.sched.warmup_steps=1',
          '--config.data.seq_length=32', '--config.data.micro_batch_size=2', '--config.data.global_batch_size=4',
          '--config.exp_manager.create_checkpoint_callback=False']
  if name.startswith('megatron') or name.startswith('hf_'):
    size += ['--config.model.num_layers=2', '--config.model.hidden_size=64', '--config.model.ffn_hidden_size=172',
             '--config.model.num_attention_heads=4', '--config.model.num_kv_heads=2',
             '--config.model.vocab_size=256', '--config.model.max_position_embeddings=64']
  if not name.startswith('megatron'):
    config_json, tok, data = _tiny_hf_dir(tmp_path)
    size += [f'--config.model.model_config={config_json}']
    if 'SFT' in name:                          # rows long enough for a whole chat (~70 tokens)
      size += ['--config.data.seq_length=128',f'--config.data.train_dir={data}', f'--config.data.val_dir={data}',
               f'--config.data.tokenizer.model={tok}/tokenizer.json', '--config.exp_manager.init_from=',
               '--config.model.model_config_overrides=()']
  out = procs.run([sys.executable, 'train.py', f'--config=configs/nxdt.py:{fixture(name)}',
                   f'--workdir={tmp_path / "run"}', *size], timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'NxD Training keys not honoured here' in out.stderr and 'trainer.devices' in out.stderr
  steps = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  assert [s['step'] for s in steps][-1] == 3


def test_export_tool_writes_yaml_that_train_py_reads_back(tmp_path):
  out = tmp_path / 'l7.yaml'
  done = procs.run([sys.executable, 'tools/export_yaml.py', '--config=configs/llama7b.py',
                    '--config.trainer.max_steps=7', f'--out={out}'], timeout=120)
  assert done.returncode == 0, done.stderr
  expected = llama7b.get_config()
  expected.trainer.max_steps = 7
  assert nxdt.load(str(out)).config.to_dict() == expected.to_dict()
  assert 'encoder_seq_length: 4096' in out.read_text()


def test_neuron_runtime_keys_are_reported_as_not_applicable_on_a_cpu_run(tmp_path):
  text = ("device: cpu\ncompiler_flags: '--model-type transformer'\ncompiler_cache_url: /home/ubuntu/neuron_cache\n"
          'neuron_rt_exec_timeout: 100\nbucket_size_collectives: 1024\n')
  mapped = nxdt.load(write_yaml(tmp_path, text))
  reasons = {k: why for k, _, why in mapped.not_honoured}
  assert set(reasons) == {'compiler_flags', 'compiler_cache_url', 'neuron_rt_exec_timeout'}
  assert 'NEURON_CC_FLAGS' in reasons['compiler_flags'] and 'cpu' in reasons['neuron_rt_exec_timeout']
  assert mapped.config.bucket_size_collectives == 1024 and mapped.config.neuron_rt_exec_timeout == 100


def test_an_unknown_tokenizer_key_is_named_too(tmp_path):
  with pytest.raises(ValueError, match='data.tokenizer.modle'):
    nxdt.load(write_yaml(tmp_path, 'data:\n  tokenizer:\n    library: huggingface\n    modle: /x\n'))
