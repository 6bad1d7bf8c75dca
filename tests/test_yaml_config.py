"""configs/yaml_config.py: YAML with NeMo / NxD Training interpolations, resolved by OmegaConf."""
import pytest

from configs import yaml_config

TEXT = """
trainer:
  max_steps: 20
distributed_strategy:
  tensor_model_parallel_size: 4
  pipeline_model_parallel_size: 2
model:
  encoder_seq_length: 4096
  max_position_embeddings: ${.encoder_seq_length}
  layernorm_epsilon: 1e-5
  lr: 3e-4
  big: 1E6
  not_a_number: 1e
  betas: [0.9, 0.95]
  optim:
    sched:
      max_steps: ${trainer.max_steps}
      from_model: ${...encoder_seq_length}
      sibling_of_optim: ${..name}
    name: adamw
parallel: ${multiply:${distributed_strategy.tensor_model_parallel_size}, ${distributed_strategy.pipeline_model_parallel_size}}
filename: 'run--${trainer.max_steps}-${model.optim.name}'
first_beta: ${model.betas[1]}
escaped: '\\${model.lr}'
selected: ${oc.select:model.missing,7}
home: ${oc.env:FLATRON_TEST_HOME}
fallback: ${oc.env:FLATRON_TEST_UNSET,/tmp}
section: ${model.optim.sched}
"""


def test_interpolations_resolve_with_their_types(tmp_path, monkeypatch):
  monkeypatch.setenv('FLATRON_TEST_HOME', '/home/me')
  path = tmp_path / 'c.yaml'
  path.write_text(TEXT)
  tree = yaml_config.read(str(path))
  m = tree['model']
  assert m['max_position_embeddings'] == 4096                 # ${.x}: a sibling, an int
  assert (m['layernorm_epsilon'], m['lr'], m['big']) == (1e-5, 3e-4, 1e6)   # floats without a dot
  assert m['not_a_number'] == '1e'
  assert m['optim']['sched'] == {'max_steps': 20, 'from_model': 4096, 'sibling_of_optim': 'adamw'}
  assert tree['parallel'] == 8                                 # NeMo's multiply resolver
  assert tree['filename'] == 'run--20-adamw'                   # formatted into a longer string
  assert (tree['home'], tree['fallback']) == ('/home/me', '/tmp')
  assert tree['section'] == m['optim']['sched']
  assert (tree['first_beta'], tree['escaped'], tree['selected']) == (0.95, '${model.lr}', 7)


@pytest.mark.parametrize('text,message', [
    ('a: ${b.c}\nb: {}\n', "a: refers to a key the file does not set (Interpolation key 'b.c' not found)"),
    ('a: ${b}\nb: ${a}\n', 'a: interpolation cycle'),
    ('a: ${nemo_only:1}\n', 'a: Unsupported interpolation type nemo_only'),
    ('a: ${b\n', "not valid YAML: no viable alternative at input '${b'"),
    ('a: [1,\n', 'not valid YAML at line 2 column 1: while parsing a flow node; did not find expected node content'),
    ('- 1\n- 2\n', 'expected a mapping'),
])
def test_bad_references_name_the_key(tmp_path, text, message):
  path = tmp_path / 'c.yaml'
  path.write_text(text)
  with pytest.raises(ValueError) as e:
    yaml_config.read(str(path))
  assert message in str(e.value)


def test_a_missing_file_is_named():
  with pytest.raises(FileNotFoundError, match='nope.yaml'):
    yaml_config.read('/nope/nope.yaml')
