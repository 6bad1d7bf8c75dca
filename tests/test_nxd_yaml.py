"""configs/nxd_yaml.py: NxD Training YAML -> flatron config, the report of keys not honoured, the
export back to YAML; the 22 example configs of NxD Training 2.26 load (those needing MoE or
MoE refused in one line), seven train 3 steps with size and data overrides only, the context-parallel
one at cp2 on two processes,
and --dry_run checks a file without touching anything."""
import json
import math
import os
import sys

import numpy as np
import pytest

from configs import (base, from_files, llama3_8b, llama7b, llama_tiny, nxd_yaml, nxd_yaml_keys, smollm2_lora, smollm2_sft,
                     validate)
from model import hf
from tests import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, 'tests', 'fixtures', 'nxd_yaml')
CURRENT = os.path.join(FIXTURES, '2.26')       # the keys and values of SDK 2.26's examples/conf
RELEASE = sorted(os.listdir(CURRENT))
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
  mapped = nxd_yaml.load(fixture(name))
  expected = module.get_config()
  if config_json:                              # the hand-written file is megatron-sourced for llama3_8b
    assert mapped.config.model_source == 'hf'
    assert set(mapped.config.model.model_config_overrides) >= {'num_layers', 'hidden_size', 'rope_theta'}
  assert _with_architecture(mapped.config, config_json) == _with_architecture(expected, config_json)


@pytest.mark.parametrize('name', sorted(MIRRORS))
def test_every_key_of_an_example_is_honoured_or_reported_with_its_reason(name):
  mapped = nxd_yaml.load(fixture(name))
  reported = {key for key, _, _ in mapped.not_honoured}
  assert all(reason for _, _, reason in mapped.not_honoured)
  from configs import yaml_config  # pylint: disable=import-outside-toplevel
  keys = nxd_yaml._flatten(yaml_config.read(fixture(name)))  # pylint: disable=protected-access
  for key in keys:
    target, note = nxd_yaml.describe(key)
    assert (key in reported) == (target == '—' or note.startswith('read only with')
                                 or key == 'model.encoder_seq_length' and key in reported), key
  assert 'trainer.devices' in reported and 'exp_manager.save_xser' in reported


def test_the_sft_example_loads_weights_only_from_resume_from_checkpoint():
  c = nxd_yaml.load(fixture('smollm2_SFT_config.yaml')).config
  assert c.exp_manager.init_from == '.data/models/smollm2-135m-instruct'
  assert c.exp_manager.resume_from_checkpoint is None
  assert c.data.tokenizer.model == '.data/models/smollm2-135m-instruct/tokenizer.json'


def test_unknown_keys_are_one_error_listing_all_with_did_you_mean(tmp_path):
  path = write_yaml(tmp_path, 'trainer:\n  max_stepz: 3\nmodel:\n  num_layer: 2\n  hidden_size: 64\nfoo: 1\n')
  with pytest.raises(ValueError) as e:
    nxd_yaml.load(path)
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
    nxd_yaml.load(write_yaml(tmp_path, text))
  assert message in str(e.value)


def test_precision_knobs_are_read_only_with_type_manual(tmp_path):
  knobs = '  master_weights: True\n  xla_use_bf16: "1"\n  neuron_rt_stochastic_rounding_en: "1"\n'
  manual = nxd_yaml.load(write_yaml(tmp_path, 'precision:\n  type: manual\n' + knobs)).config.precision
  assert (manual.parameter_dtype, manual.master_weights, manual.stochastic_rounding) == ('bf16', True, True)
  mapped = nxd_yaml.load(write_yaml(tmp_path, 'precision:\n  type: mixed_precision\n' + knobs, 'm.yaml'))
  assert mapped.config.precision.to_dict() == dict(base.get_config().precision.to_dict(), type='mixed_precision')
  assert {k for k, _, _ in mapped.not_honoured} == {'precision.master_weights', 'precision.xla_use_bf16',
                                                    'precision.neuron_rt_stochastic_rounding_en'}


@pytest.mark.parametrize('module', [llama_tiny, llama7b, llama3_8b, smollm2_sft, smollm2_lora])
def test_export_to_yaml_reads_back_to_the_same_config(tmp_path, module):
  config = module.get_config()
  path = write_yaml(tmp_path, nxd_yaml.to_yaml(config))
  assert nxd_yaml.load(path).config.to_dict() == config.to_dict()


def test_every_documented_key_is_honoured_or_not_applicable():
  known = nxd_yaml._known(base.get_config())  # pylint: disable=protected-access
  for key in nxd_yaml.DOCUMENTED:
    target, note = nxd_yaml.describe(key)
    if target == '—':
      assert note.startswith(('not applicable: ', 'not yet: ')) and len(note) > 20, key
      assert note.startswith('not applicable: ') or nxd_yaml.missing_feature(key), key   # 'not yet': MoE and CP only
    else:
      assert target.split(' ')[0] in known, (key, target)


def test_the_readme_table_is_the_code_s():
  with open(os.path.join(ROOT, 'docs', 'nxd-migration.md'), encoding='utf-8') as f:
    assert nxd_yaml.table() in f.read(), 'docs/nxd-migration.md is out of date: paste configs.nxd_yaml.table()'


def test_export_tool_writes_yaml_that_train_py_reads_back(tmp_path):
  out = tmp_path / 'l7.yaml'
  done = procs.run([sys.executable, '-m', 'tools.export_yaml', '--config=configs/llama7b.py',
                    '--config.trainer.max_steps=7', f'--out={out}'], timeout=120)
  assert done.returncode == 0, done.stderr
  expected = llama7b.get_config()
  expected.trainer.max_steps = 7
  assert nxd_yaml.load(str(out)).config.to_dict() == expected.to_dict()
  assert 'encoder_seq_length: 4096' in out.read_text()


def test_neuron_runtime_keys_are_reported_as_not_applicable_on_a_cpu_run(tmp_path):
  text = ("device: cpu\ncompiler_flags: '--model-type transformer'\ncompiler_cache_url: /home/ubuntu/neuron_cache\n"
          'neuron_rt_exec_timeout: 100\nbucket_size_collectives: 1024\n')
  mapped = nxd_yaml.load(write_yaml(tmp_path, text))
  reasons = {k: why for k, _, why in mapped.not_honoured}
  assert set(reasons) == {'compiler_flags', 'compiler_cache_url', 'neuron_rt_exec_timeout'}
  assert 'NEURON_CC_FLAGS' in reasons['compiler_flags'] and 'cpu' in reasons['neuron_rt_exec_timeout']
  assert mapped.config.bucket_size_collectives == 1024 and mapped.config.neuron_rt_exec_timeout == 100


def test_limit_test_batches_is_reported_not_run_as_nxd_runs_no_test_loop():
  mapped = nxd_yaml.load(current('megatron_llama2_7B_SFT_config.yaml'))       # trainer.limit_test_batches: 1
  reasons = {k: why for k, _, why in mapped.not_honoured}
  assert 'no test loop' in reasons['trainer.limit_test_batches']
  assert mapped.config.trainer.limit_test_batches == 0
  assert not [p for p in validate.check(mapped.config) if 'limit_test_batches' in p]


def test_an_unknown_tokenizer_key_is_named_too(tmp_path):
  with pytest.raises(ValueError, match='data.tokenizer.modle'):
    nxd_yaml.load(write_yaml(tmp_path, 'data:\n  tokenizer:\n    library: huggingface\n    modle: /x\n'))


# --- NxD Training 2.26's example configs ----------------------------------------------------


def current(name):
  return os.path.join(CURRENT, name)


def needs(name):
  """The feature a 2.26 file needs that flatron lacks (its one-line refusal), or None."""
  return None           # MoE / EP and context parallelism are built: no 2.26 file is refused


def test_the_fixtures_are_the_22_files_of_the_release():
  assert len(RELEASE) == 22 and all(n.endswith('_config.yaml') for n in RELEASE)


@pytest.mark.parametrize('name', RELEASE)
def test_every_file_of_the_current_release_loads_or_names_the_one_missing_feature(name):
  if needs(name):
    with pytest.raises(ValueError) as e:
      nxd_yaml.load(current(name))
    assert len(str(e.value).splitlines()) == 1
    assert f'needs {needs(name)} (' in str(e.value) and 'which flatron does not have yet' in str(e.value)
    return
  mapped = nxd_yaml.load(current(name))
  from configs import yaml_config  # pylint: disable=import-outside-toplevel
  reported = {key for key, _, _ in mapped.not_honoured}
  for key in nxd_yaml._flatten(yaml_config.read(current(name))):  # pylint: disable=protected-access
    target, note = nxd_yaml.describe(key)
    if target == '—' or note.startswith('read only with'):
      assert key in reported, key          # every key not honoured is in the printed table


def test_the_readme_lists_what_a_migrating_user_still_lacks():
  with open(os.path.join(ROOT, 'docs', 'nxd-migration.md'), encoding='utf-8') as f:
    assert nxd_yaml.lacks() in f.read(), 'docs/nxd-migration.md is out of date: paste configs.nxd_yaml.lacks()'
  lacking = {needs(n) for n in RELEASE} - {None}
  assert lacking == set(nxd_yaml_keys.MISSING_FEATURES)     # each listed feature is still refused, and only those


def test_current_release_keys_map_where_they_mean_something():
  trn2 = nxd_yaml.load(current('hf_llama3_70B_trn2_config.yaml'))
  c = trn2.config
  assert c.distributed_strategy.pipeline_cuts == (19, 40, 61)          # model.layers.18 ends stage 0
  assert c.model.activations_checkpoint_recompute == ('norm', 'activation')   # LlamaRMSNorm, ActivationMultiplyMLP
  assert c.precision.parallel_layers_reduce_dtype == 'bf16'
  reasons = {k: why for k, _, why in trn2.not_honoured}
  assert {'trainer.lnc', 'trainer.sequential_move_factor',
          'exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt'} <= set(reasons)
  assert 'fp32 masters' in reasons['exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt']
  assert nxd_yaml.load(current('megatron_mistral_config.yaml')).config.model.sliding_window == 4096
  assert 'model.transpose_nki_inputs' in {k for k, _, _ in nxd_yaml.load(current('hf_llama3_8B_SFT_config.yaml')).not_honoured}
  gpt = nxd_yaml.load(current('megatron_gpt_config.yaml')).config
  assert (gpt.data.tokenizer.type, gpt.model.vocab_size) == ('gpt2', 0)   # 0: the tokenizer's, at start-up


@pytest.mark.parametrize('section, objective', [('dpo', 'dpo'), ('orpo', 'orpo')])
def test_a_preference_section_selects_its_objective(tmp_path, section, objective):
  assert nxd_yaml.load(current(f'hf_llama3_8B_{section.upper()}_config.yaml')).config.model.objective == objective
  both = 'model_alignment_strategy:\n  dpo: {kl_beta: 0.1}\n  orpo: {beta: 0.1}\n'
  with pytest.raises(ValueError, match='both dpo and orpo sections'):
    nxd_yaml.load(write_yaml(tmp_path, both))
  clash = f'model:\n  objective: next_token\nmodel_alignment_strategy:\n  {section}: {{}}\n'
  with pytest.raises(ValueError, match=f"model.objective='next_token' but the file has a model_alignment_strategy.{section}"):
    nxd_yaml.load(write_yaml(tmp_path, clash, 'clash.yaml'))


def test_megatron_library_with_a_path_is_an_hf_tokenizer(tmp_path):
  text = 'data:\n  tokenizer:\n    library: megatron\n    type: /models/llama_tokenizer\n'
  t = nxd_yaml.load(write_yaml(tmp_path, text)).config.data.tokenizer
  assert (t.type, t.model) == ('huggingface', '/models/llama_tokenizer/tokenizer.json')


def _assets(tmp_path):
  """A tiny HF config.json, a tokenizer (400 ids), chats, preference pairs, pre-tokenized
  sequences and a Megatron corpus: the data and size the overrides point the files at."""
  from tests.test_chat import tokenizer_dir  # pylint: disable=import-outside-toplevel
  from tests.test_sft import CHATS, write_jsonl  # pylint: disable=import-outside-toplevel
  from tests.parity import write_pairs  # pylint: disable=import-outside-toplevel
  from data import indexed  # pylint: disable=import-outside-toplevel
  config = llama_tiny.get_config().model
  config.vocab_size = 512
  (tmp_path / 'config.json').write_text(json.dumps(hf.config_to_hf(config)))
  g = np.random.default_rng(0)
  seqs = [g.integers(0, 256, 33).tolist() for _ in range(16)]
  (tmp_path / 'pretok.jsonl').write_text(''.join(json.dumps({'input_ids': s, 'labels': s}) + '\n' for s in seqs))
  indexed.write(str(tmp_path / 'corpus'), [g.integers(1, 256, int(g.integers(20, 60))) for _ in range(60)], np.int32)
  write_pairs(tmp_path / 'pairs.jsonl', 32, 0)
  return {'config': tmp_path / 'config.json', 'tok': tokenizer_dir(tmp_path / 'tok') + '/tokenizer.json',
          'chats': write_jsonl(tmp_path / 'chats.jsonl', CHATS * 8), 'pairs': tmp_path / 'pairs.jsonl',
          'pretok': tmp_path / 'pretok.jsonl', 'corpus': tmp_path / 'corpus'}


SIZE = ['--config.trainer.max_steps=3', '--config.model.optim.sched.warmup_steps=1', '--config.data.seq_length=32',
        '--config.data.micro_batch_size=1', '--config.data.global_batch_size=2', '--config.model.num_layers=2',
        '--config.model.hidden_size=64', '--config.model.ffn_hidden_size=172', '--config.model.num_attention_heads=4',
        '--config.model.num_kv_heads=2', '--config.distributed_strategy.tensor_model_parallel_size=1',
        '--config.distributed_strategy.pipeline_model_parallel_size=1', '--config.distributed_strategy.kv_replicator=1']
HF = ['--config.model.model_config={config}', '--config.exp_manager.init_from=',
      '--config.exp_manager.resume_from_checkpoint=']
MEGATRON = ["--config.data.data_prefix=(1.0,'{corpus}')", '--config.data.splits_string=80,10,10',
            '--config.data.tokenizer.model={tok}']
SFT = ['--config.data.seq_length=128', '--config.data.train_dir={chats}', '--config.data.val_dir={chats}',
       '--config.data.tokenizer.model={tok}']
PAIRS = ['--config.data.train_dir={pairs}', '--config.data.tokenizer.model={tok}']
TRAINS = {    # the seven named by the issue: size overrides, and data the tests have
    'megatron_llama_7B_config.yaml': MEGATRON,
    'megatron_mistral_config.yaml': MEGATRON,
    'hf_llama3_8B_config.yaml': HF + ['--config.data.train_dir={pretok}'],
    'hf_llama3_8B_SFT_config.yaml': HF + SFT,
    'hf_llama3_8B_SFT_lora_config.yaml': HF + SFT,
    'hf_llama3_8B_DPO_config.yaml': HF + PAIRS,
    'hf_llama3_8B_ORPO_config.yaml': HF + PAIRS,
}


@pytest.mark.parametrize('name', sorted(TRAINS))
def test_the_current_release_files_train_3_steps_with_size_and_data_overrides_only(tmp_path, name):
  paths = _assets(tmp_path)
  overrides = [flag.format(**paths) for flag in SIZE + TRAINS[name]]
  out = procs.run([sys.executable, 'train.py', f'--config=configs/nxd_yaml.py:{current(name)}',
                   f'--workdir={tmp_path / "run"}', *overrides], timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'NxD Training keys not honoured here' in out.stderr and 'trainer.devices' in out.stderr
  assert 'model 2 layers x hidden 64 | heads 4 (kv 2)' in out.stderr      # the command line over config.json
  steps = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  assert [s['step'] for s in steps][-1] == 3 and all(math.isfinite(s['loss']) for s in steps)
  if name.startswith('megatron'):         # no vocab_size in the file: the tokenizer's (400), padded
    assert "model.vocab_size=400: the tokenizer's; the embedding pads it to 400 rows" in out.stderr
  if 'DPO' in name:                       # validation off: no validation split is read, nor precomputed
    assert 'of 32 train pairs precomputed' in out.stderr and 'valid pairs' not in out.stderr
  if name == 'hf_llama3_8B_config.yaml':
    assert 'pretraining train: 16 examples' in out.stderr


def test_the_context_parallel_file_trains_3_steps_at_cp2_with_size_and_data_overrides_only(tmp_path):
  name = 'hf_llama3_70B_CP_config.yaml'
  c = nxd_yaml.load(current(name)).config
  assert (c.distributed_strategy.context_parallel_size, c.model.fusions.ring_attention) == (2, True)
  paths = _assets(tmp_path)
  overrides = [flag.format(**paths) for flag in SIZE + HF + ['--config.data.train_dir={pretok}']]
  out = procs.run([os.path.join(os.path.dirname(sys.executable), 'torchrun'), '--nproc_per_node=2', '--standalone',
                   'train.py', f'--config=configs/nxd_yaml.py:{current(name)}', f'--workdir={tmp_path / "run"}',
                   *overrides], timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'dp=1 x pp=1 x cp=2 (ring attention) x tp=1' in out.stderr
  steps = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  assert [s['step'] for s in steps][-1] == 3 and all(math.isfinite(s['loss']) for s in steps)


def test_dry_run_resolves_validates_and_prints_without_touching_the_workdir(tmp_path):
  paths = _assets(tmp_path)
  overrides = [flag.format(**paths) for flag in SIZE + TRAINS['hf_llama3_8B_SFT_lora_config.yaml']]
  workdir = tmp_path / 'never'
  out = procs.run([sys.executable, 'train.py', f'--config=configs/nxd_yaml.py:{current("hf_llama3_8B_SFT_lora_config.yaml")}',
                   f'--workdir={workdir}', '--dry_run', *overrides, '--config.data.global_batch_size=4'], timeout=120, env=dict(os.environ, WORLD_SIZE='4'))
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'resolved flatron config:' in out.stdout and 'lora_rank: 16' in out.stdout
  assert 'NxD Training keys not honoured here' in out.stderr                  # the key report
  assert '4 process(es) on cpu: dp=4 x pp=1 x tp=1' in out.stdout and 'memory/rank (estimate)' in out.stdout
  assert 'model 2 layers x hidden 64' in out.stdout and 'LoRA r=16' in out.stdout
  assert not workdir.exists()
  bad = procs.run([sys.executable, 'train.py', f'--config=configs/nxd_yaml.py:{current("hf_llama3_8B_SFT_config.yaml")}',
                   '--dry_run', *overrides, '--config.data.micro_batch_size=3'], timeout=120)
  assert bad.returncode == 2 and 'global_batch_size=2 is not divisible by micro_batch_size' in bad.stderr


def test_the_first_name_of_the_module_still_loads_a_file():
  from configs import nxdt  # pylint: disable=import-outside-toplevel
  path = current('megatron_llama_7B_config.yaml')
  assert nxdt.get_config(path).to_dict() == nxd_yaml.get_config(path).to_dict()


@pytest.mark.parametrize('name, layout', [
    ('hf_mixtral_8x7b_config.yaml', ['--config.distributed_strategy.expert_model_parallel_size=2']),
    ('hf_mixtral_8x7b_dropless_config.yaml', ['--config.distributed_strategy.expert_model_parallel_size=2']),
    ('hf_mixtral_8x7b_config.yaml', ['--config.distributed_strategy.tensor_model_parallel_size=2',      # + the file's SP
                                     '--config.distributed_strategy.pipeline_model_parallel_size=2'])])
def test_hf_mixtral_trains_3_steps_with_size_overrides_only(tmp_path, name, layout):
  """ep 2 over dp 2, or tp 2 x pp 2 as the file's tp 32 x pp 4 in small (the router loss across the
  stages); the YAML's capacity / dropless settings win over config.json's (HF routes dropless),
  as its other architecture keys do."""
  paths = _assets(tmp_path)
  mixtral = llama_tiny.get_config().model
  mixtral.vocab_size = 512
  mixtral.moe.update(num_experts=8, dropless=True)
  (tmp_path / 'mixtral.json').write_text(json.dumps(hf.config_to_hf(mixtral)))
  overrides = [flag.format(**paths) for flag in SIZE + HF + ['--config.data.train_dir={pretok}']]
  overrides = [o.replace(str(paths['config']), str(tmp_path / 'mixtral.json')) for o in overrides]
  nproc = 4 if 'tensor' in layout[0] else 2
  out = procs.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}', 'train.py',
                   f'--config=configs/nxd_yaml.py:{current(name)}', f'--workdir={tmp_path / "run"}', *overrides,
                   *layout], timeout=300)      # after SIZE's tp = pp = 1: the later value wins
  assert out.returncode == 0, out.stderr[-3000:]
  steps = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  assert [s['step'] for s in steps][-1] == 3 and all(math.isfinite(s['loss']) for s in steps)
  assert all(s['moe_aux_loss'] > 0 for s in steps)
  if 'dropless' in name:     # (with capacity 2.0, whether a token drops in 3 steps is up to the routing)
    assert all(s['moe_dropped_fraction'] == 0 for s in steps)
  config = json.load(open(tmp_path / 'run' / 'config.json'))
  assert config['model']['moe']['num_experts'] == 8 and config['model']['moe']['dropless'] == ('dropless' in name)
  assert config['model']['moe']['capacity_factor'] == (0.0 if 'dropless' in name else 2.0)
  d = config['distributed_strategy']
  assert (d['tensor_model_parallel_size'], d['pipeline_model_parallel_size'], d['expert_model_parallel_size']) == \
      ((2, 2, 1) if nproc == 4 else (1, 1, 2)) and d['sequence_parallel']


# Every release file at its own world size and layout, on its own cluster, with the model's
# config.json from its public model card (HF files) or the vocabulary of the tokenizer it names
# (Megatron files: Llama-2's 32,000; GPT-2's 50,257; Mixtral's 32,000): tools/trace_nxd.load.
DENSE = [name for name in RELEASE if 'mixtral' not in name]
MIXTRAL = [name for name in RELEASE if 'mixtral' in name]


def _own_dry_run(name, kv_replicator=None):
  from estimates import summary  # pylint: disable=import-outside-toplevel
  from tools import trace_nxd  # pylint: disable=import-outside-toplevel
  config, world_size = trace_nxd.load(name, kv_replicator)
  return world_size, summary.dry_run_report(config, world_size, validate.check)


def test_every_dense_release_file_fits_its_cluster_at_its_own_layout():
  assert len(DENSE) == 18
  for name in DENSE:
    world_size, (text, refusal) = _own_dry_run(name)
    assert refusal is None, (name, refusal)
    fits = next(line for line in text.splitlines() if line.startswith('memory: '))
    assert fits.startswith('memory: fits a trn'), (name, fits)
    assert f'predicted on {world_size:,} devices' in text, name


def test_the_70b_files_fit_a_trn1_and_a_trn2_device():
  for name, limit in (('hf_llama3_70B_config.yaml', 16), ('hf_llama3_70B_trn2_config.yaml', 24)):
    _, (text, _) = _own_dry_run(name)
    fits = next(line for line in text.splitlines() if line.startswith('memory: '))
    used = float(fits.split(': ')[2].split(' GiB of ')[0])
    assert used <= limit and f'of {limit}.0 GiB' in fits, fits


def test_the_mixtral_files_fit_a_trn1_device_at_their_own_layout():
  """tp 32 x pp 4, the router losses across the stages, each expert split over the 32 TP ranks.
  NxD's HF files leave kv_replicator unset with 8 KV heads: the refusal names the value."""
  assert len(MIXTRAL) == 4
  for name in MIXTRAL:
    kv = 4 if name.startswith('hf_') else None
    if kv:
      with pytest.raises(ValueError, match='set distributed_strategy.kv_replicator=4'):
        _own_dry_run(name)
    world_size, (text, refusal) = _own_dry_run(name, kv)
    assert refusal is None, (name, refusal)
    fits = next(line for line in text.splitlines() if line.startswith('memory: '))
    assert fits.startswith('memory: fits a trn1.32xlarge') and float(fits.split(': ')[2].split(' GiB')[0]) <= 16, fits
    assert f'predicted on {world_size:,} devices' in text and world_size in (256, 512), name
