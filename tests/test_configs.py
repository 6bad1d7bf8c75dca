"""Model configs, presets, the base config and the up-front validation."""
import importlib
import os

import pytest

from configs import base, cli, validate
from model import defaults, param_table
from optim import schedules

PUBLISHED = {'llama7b': 6_738_415_616, 'llama3_8b': 8_030_261_248, 'llama3_70b': 70_553_706_496,
             'gpt_oss_120b': 116_829_156_672, 'deepseek_v3': 671_026_419_200}
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures')
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')
ALL = tuple(sorted(n[:-3] for n in os.listdir(CONFIGS) if n.endswith('.py') and n not in cli.NOT_MODELS))


def load(name, arg=None):
  return importlib.import_module(f'configs.{name}').get_config(arg)


def offers(name, preset):
  """Whether configs/NAME.py lists `preset` among its valid ones."""
  try:
    load(name, '?')
  except ValueError as e:
    return f'{preset!r}' in str(e).split('valid: ')[-1]
  raise AssertionError(f'{name}: an unknown preset was accepted')


SMOKE = tuple(name for name in ALL if offers(name, 'smoke'))


@pytest.mark.parametrize('name', sorted(PUBLISHED))
def test_parameter_count_equals_published_size(name):
  assert param_table.count_params(load(name).model) == PUBLISHED[name]


@pytest.mark.parametrize('name', ['gpt_oss_120b', 'deepseek_v3'])
def test_a_published_model_is_its_config_json(name):
  """configs/NAME.py's model section against the released config.json (the fixture: its
  published values) read by model/hf.py over it: nothing changes."""
  from model import hf  # pylint: disable=import-outside-toplevel
  ours = load(name).model
  read = hf.read_config(os.path.join(FIXTURES, 'hf_configs', f'{name}_config.json'), ours)
  assert read.to_dict() == ours.to_dict()


def test_gpt_oss_20b_has_its_published_size():
  assert param_table.count_params(load('gpt_oss_120b', '20b').model) == 20_914_757_184


def test_the_model_section_is_the_models_defaults_and_shares_its_lora_keys():
  config = base.get_config()
  model = config.model.to_dict()
  assert model.pop('optim') is not None                       # the optimizer's keys, added by configs/base.py
  assert model == defaults.model_section().to_dict()
  config.model_alignment_strategy.peft.lora_rank = 8           # NxD's path for LoRA is what the model reads
  assert config.model.peft.lora_rank == 8


def test_gpt_345m_count_and_features():
  m = load('gpt_345m').model
  # Megatron GPT-2 medium: 24 x (12 h^2 + 13 h) + (V + 1024) h + 2h with tied embeddings.
  h, v = 1024, 50257
  assert param_table.count_params(m) == 24 * (12 * h * h + 13 * h) + (v + 1024) * h + 2 * h
  assert param_table.padded_vocab_size(m) == 50304
  specs = param_table.param_specs(m)
  assert 'lm_head.weight' not in specs and 'embed_positions.weight' in specs
  assert 'layers.0.mlp.gate_proj.weight' not in specs and 'layers.0.mlp.up_proj.bias' in specs


@pytest.mark.parametrize('name', ALL)
def test_every_config_validates(name):
  validate.validate(load(name))


def test_the_big_configs_offer_smoke():
  assert {'llama7b', 'llama3_8b', 'llama3_70b', 'gpt_345m'} <= set(SMOKE)


@pytest.mark.parametrize('name', SMOKE)
def test_smoke_preset_keeps_features_and_shrinks(name):
  full, smoke = load(name), load(name, 'smoke')
  validate.validate(smoke)
  assert param_table.count_params(smoke.model) < 1_000_000
  for key in ('position_embedding_type', 'normalization', 'activation', 'has_bias',
              'share_embeddings_and_output_weights'):
    assert smoke.model[key] == full.model[key]
  def is_gqa(m):
    return 0 < m.num_kv_heads < m.num_attention_heads
  assert is_gqa(smoke.model) == is_gqa(full.model)


@pytest.mark.parametrize('name', SMOKE)
def test_smoke_preset_leaves_warm_up_within_its_steps(name):
  c = load(name, 'smoke')
  assert not validate.check(c)
  sched, steps = c.model.optim.sched, c.trainer.max_steps
  assert schedules.warmup_steps(sched, steps) < schedules.schedule_length(sched, steps)


def test_unknown_preset_is_an_error():
  with pytest.raises(ValueError, match='unknown preset'):
    load('llama7b', 'huge')


@pytest.mark.parametrize('name, valid', [
    ('llama7b', "'smoke' or none"), ('llama_tiny', "'test' or none"), ('llama_50m', 'none')])
def test_every_config_names_its_presets_the_same_way(name, valid):
  with pytest.raises(ValueError) as e:
    load(name, 'bogus')
  assert str(e.value) == f"{name}: unknown preset 'bogus'; valid: {valid}"
  assert load(name, '').to_dict() == load(name, None).to_dict()


def test_warm_up_as_long_as_the_run_is_an_error_naming_both_keys():
  c = load('llama7b', 'smoke')
  c.model.optim.sched.warmup_steps = 10
  problems = validate.check(c)
  assert any('model.optim.sched.warmup_steps=10' in p and 'trainer.max_steps=10' in p for p in problems)
  c.model.optim.sched.warmup_steps, c.model.optim.sched.max_steps = 20, 15
  assert any('model.optim.sched.max_steps=15' in p for p in validate.check(c))
  c.model.optim.sched.warmup_steps = 9
  c.model.optim.sched.max_steps = None
  assert not validate.check(c)


@pytest.mark.parametrize('key', ('init_method_std', 'layernorm_epsilon', 'rope_theta'))
@pytest.mark.parametrize('value', (float('nan'), float('inf')))
def test_non_finite_numbers_are_rejected(key, value):
  c = base.get_config()
  c.model[key] = value
  assert any(p.startswith(f'model.{key}=') and 'finite' in p for p in validate.check(c))


def test_kv_heads_below_zero_or_no_heads_are_reported_not_crashes():
  c = base.get_config()
  c.model.num_kv_heads = -2
  assert any(p.startswith('model.num_kv_heads=-2 must be >= 0') for p in validate.check(c))
  c = base.get_config()
  c.model.num_attention_heads = 0
  assert any(p.startswith('model.num_attention_heads=0') for p in validate.check(c, world_size=2))


def test_validation_reports_every_problem_at_once():
  c = base.get_config()
  c.model.normalization = 'batchnorm'
  c.model.num_attention_heads = 6           # 64 % 6 != 0
  c.model.optim.name = 'adamx'
  c.precision.type = 'fp8'
  c.data.global_batch_size = 7
  c.data.micro_batch_size = 2
  problems = validate.check(c)
  text = '\n'.join(problems)
  for needle in ('model.normalization', 'rmsnorm', 'model.hidden_size=64', 'model.optim.name',
                 'adamw', 'precision.type', 'data.global_batch_size=7'):
    assert needle in text
  with pytest.raises(validate.ConfigError, match=r'\d+ problems'):
    validate.validate(c)


def test_layout_errors_name_the_keys():
  c = base.get_config()
  c.model.num_attention_heads, c.model.num_kv_heads, c.model.hidden_size = 8, 2, 64
  c.distributed_strategy.tensor_model_parallel_size = 4
  text = '\n'.join(validate.check(c, world_size=4))
  assert 'kv_replicator=2' in text                     # tp 4 > 2 kv heads: the fix is named
  c.distributed_strategy.tensor_model_parallel_size = 3
  text = '\n'.join(validate.check(c, world_size=4))
  assert 'world size 4 is not divisible' in text
  assert 'num_attention_heads=8 is not divisible' in text
  c = base.get_config()
  c.distributed_strategy.sequence_parallel = True
  assert validate.check(c) == []           # a no-op at tp 1 (Megatron's rule): a warning, not an error
  assert any('sequence_parallel=True does nothing at tensor_model_parallel_size=1' in w for w in validate.warnings(c))
  c = base.get_config()
  c.distributed_strategy.pipeline_model_parallel_size = 4
  c.distributed_strategy.virtual_pipeline_model_parallel_size = 2
  assert any('num_layers=2 < pipeline_model_parallel_size' in p for p in validate.check(c, 4))


def test_global_batch_must_divide_by_micro_batch_times_dp():
  c = base.get_config()
  c.data.global_batch_size, c.data.micro_batch_size = 8, 2
  assert not validate.check(c, world_size=1)
  assert any('micro_batch_size x data-parallel size = 2 x 8' in p for p in validate.check(c, world_size=8))


def test_learned_positions_need_room_for_the_sequence():
  c = load('gpt_345m', 'smoke')
  c.data.seq_length = 256
  assert any('max_position_embeddings' in p for p in validate.check(c))


def test_rope_beyond_max_positions_is_a_warning_not_an_error():
  c = load('llama_tiny', None)
  c.data.seq_length = 512
  assert not validate.check(c) and 'RoPE extrapolates' in validate.warnings(c)[0]


def test_save_top_k_keeps_all_with_minus_one_and_rejects_zero():
  c = load('llama_tiny', None)
  c.exp_manager.checkpoint_callback_params.save_top_k = -1
  assert not validate.check(c)
  c.exp_manager.checkpoint_callback_params.save_top_k = 0
  assert any('save_top_k=0' in p for p in validate.check(c))


def test_epochs_and_the_test_split_need_finite_data_naming_the_fix():
  c = base.get_config()                     # the synthetic stream
  c.trainer.max_epochs, c.trainer.check_val_every_n_epoch = 2, 1
  text = '\n'.join(validate.check(c))
  assert ('trainer.max_epochs=2 counts passes over the train split, but the synthetic stream (data.data_prefix=()) '
          'has no epochs; set data.data_prefix or data.train_dir, or trainer.max_epochs=-1') in text
  assert 'trainer.check_val_every_n_epoch=1 counts passes' in text and 'check_val_every_n_epoch=None' in text
  c.data.data_prefix = ('corpus',)
  assert not validate.check(c)
  c.trainer.max_epochs, c.trainer.check_val_every_n_epoch, c.trainer.limit_test_batches = 0, 0, -1
  text = '\n'.join(validate.check(c))
  for needle in ('trainer.max_epochs=0 must be > 0', 'trainer.check_val_every_n_epoch=0 must be > 0',
                 'trainer.limit_test_batches=-1 must be >= 0'):
    assert needle in text
  c = base.get_config()
  c.trainer.limit_test_batches = 2
  assert not validate.check(c)              # the synthetic stream has a test split
  c.data.data_prefix, c.data.splits_string = ('corpus',), '98,2,0'
  assert ["data.splits_string='98,2,0' gives the test split no documents but trainer.limit_test_batches=2; give "
          "its third part a share (e.g. '980,10,10') or set trainer.limit_test_batches=0"] == validate.check(c)
  c.data.train_dir = 'sft.jsonl'
  assert ['trainer.limit_test_batches=2 evaluates the test records: set data.test_dir (same formats as '
          'data.val_dir), or trainer.limit_test_batches=0'] == validate.check(c)
  c.data.test_dir = 'test.jsonl'
  assert not validate.check(c)


def test_checkpoint_ranking_naming_and_run_names_are_checked_naming_the_fix():
  c = base.get_config()
  p = c.exp_manager.checkpoint_callback_params
  p.monitor, p.mode, p.filename = 'val_acc', 'best', 'ckpt-{consumed_samples}'
  c.exp_manager.name = 'a/b'
  text = '\n'.join(validate.check(c))
  for needle in ("checkpoint_callback_params.monitor='val_acc' is unknown; valid: step, val_loss",
                 "checkpoint_callback_params.mode='best' is unknown; valid: min, max",
                 "checkpoint_callback_params.filename='ckpt-{consumed_samples}' must hold {step} exactly once",
                 "exp_manager.name='a/b' names a directory"):
    assert needle in text
  p.monitor, p.mode, p.filename, c.exp_manager.name = 'val_loss', 'min', 'ckpt-{step}-{consumed_samples}', 'trial'
  assert not validate.check(c)
  c.trainer.limit_val_batches = 0
  assert any("monitor='val_loss' ranks steps by validation, but trainer.limit_val_batches=0" in p
             for p in validate.check(c))
  c = base.get_config()
  c.model.objective, c.data.train_dir = 'dpo', 'pairs.jsonl'
  c.exp_manager.checkpoint_callback_params.monitor = 'val_rewards/accuracies'   # an objective's metric
  assert not validate.check(c)


def test_model_config_overrides_must_name_model_keys():
  c = base.get_config()
  c.model.model_config_overrides = ('num_layers', 'num_layerz', 'optim')
  problems = validate.check(c)
  assert sum('model_config_overrides' in p for p in problems) == 2
  assert any("'num_layerz'" in p for p in problems) and any("'optim'" in p for p in problems)


def test_command_line_model_keys_join_the_overrides_of_config_json():
  c = base.get_config()
  c.model_source, c.model.model_config_overrides = 'hf', ('rope_theta',)
  cli.command_line_wins(c, {'model.num_layers': 2, 'model.optim.lr': 1e-3, 'data.seq_length': 8})
  assert c.model.model_config_overrides == ('rope_theta', 'num_layers')
  # beside an explicit model_config_overrides too: a key typed on the command line is never dropped
  cli.command_line_wins(c, {'model.model_config_overrides': (), 'model.hidden_size': 64})
  assert c.model.model_config_overrides == ('rope_theta', 'num_layers', 'hidden_size')
  c.model_source = 'megatron'
  cli.command_line_wins(c, {'model.ffn_hidden_size': 64})
  assert 'ffn_hidden_size' not in c.model.model_config_overrides
