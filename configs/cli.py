"""One-line explanations of command-line mistakes: a missing config file, an unknown preset,
a misspelled `--config.a.b` key (with the nearest real key)."""
import difflib
import importlib.util
import os

from absl import flags
from ml_collections import config_dict

import user_errors

NOT_MODELS = ('__init__.py', 'base.py', 'cli.py', 'from_files.py', 'presets.py', 'validate.py', 'yaml_config.py',
              'nxd_yaml.py', 'nxd_yaml_keys.py', 'nxdt.py')  # nxd_yaml.py needs a YAML: --config=configs/nxd_yaml.py:file.yaml


def flatten(tree, prefix='', leaves=()) -> dict:
  """{dotted path: value} of every leaf of nested dicts or ConfigDicts; an empty section and
  the paths in `leaves` are leaves themselves."""
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if isinstance(value, (dict, config_dict.ConfigDict)) and value and path not in leaves:
      out.update(flatten(value, path + '.', leaves))
    else:
      out[path] = value
  return out


def flat_keys(config):
  """Every leaf key of a ConfigDict as a dotted path."""
  return list(flatten(config))


def load(spec):
  """`path.py[:preset]` -> the config, the way config_flags loads it."""
  path, _, preset = spec.partition(':')
  if not os.path.isfile(path):
    here = sorted(f'configs/{n}' for n in os.listdir('configs') if n.endswith('.py')
                  and n not in NOT_MODELS) if os.path.isdir('configs') else []
    raise FileNotFoundError(f'--config={spec}: no such config file {path!r}'
                            + (f' (configs here: {", ".join(here)})' if here else ''))
  module_spec = importlib.util.spec_from_file_location('_flatron_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(preset or None)


def unknown_key(config, key):
  """None if `key` (dotted) exists in `config`, else a message with a did-you-mean."""
  node = config
  for part in key.split('.'):
    if not isinstance(node, config_dict.ConfigDict) or part not in node:
      keys = flat_keys(config)
      close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
      if not close:   # a wrong section: match the last part against every key's last part
        tails = {k.rsplit('.', 1)[-1]: k for k in keys}
        close = [tails[t] for t in difflib.get_close_matches(key.rsplit('.', 1)[-1], tails, n=1)]
      return f'--config.{key}: no such key' + (f'; did you mean {close[0]}?' if close else '')
    node = node[part]
  return None


def explain(argv, error) -> str:
  """One line for a flag-parsing failure of train.py."""
  spec = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  if spec is not None:
    try:
      config = load(spec)
    except Exception as e:  # pylint: disable=broad-except
      said = user_errors.describe(e)
      return f'--config={spec}: {said}' if not said.startswith('--config=') else said
    for arg in argv:
      if arg.startswith('--config.'):
        if message := unknown_key(config, arg[len('--config.'):].split('=', 1)[0]):
          return message
  return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def command_line_wins(config, overrides):
  """config.json, then the YAML, then the command line: with model_source=hf, a model key given
  on the command line (`overrides`: config_flags' flat dict) joins model.model_config_overrides,
  so config.json does not replace it at start-up (also beside an explicit model_config_overrides:
  a key typed on the command line is never dropped)."""
  if config.model_source != 'hf':
    return
  keys = [('.'.join(k.split('.')[1:3]) if k.split('.')[1] == 'moe' else k.split('.')[1])
          for k in overrides if k.startswith('model.') and k.split('.')[1] not in
          ('model_config', 'model_config_overrides', 'optim', 'peft', 'fusions')]
  if keys:
    config.model.model_config_overrides = tuple(dict.fromkeys([*config.model.model_config_overrides, *keys]))


class DryRunParser(flags.ArgumentParser):
  """--dry_run (the estimate), --dry_run=trace (and one rank's step traced: step_trace.py),
  --nodry_run: a boolean flag that also takes `trace`."""
  VALUES = {'true': 'estimate', '1': 'estimate', 'estimate': 'estimate', 'trace': 'trace', 'false': '', '0': '', '': ''}

  def parse(self, argument):
    if isinstance(argument, bool):
      return 'estimate' if argument else ''
    value = self.VALUES.get(str(argument).lower())
    if value is None:
      raise ValueError(f'--dry_run={argument}: use --dry_run (the estimate), --dry_run=trace or --nodry_run')
    return value

  def flag_type(self):
    return 'dry run'


def define_dry_run(help_text):
  """The --dry_run flag: '' (a run), 'estimate' or 'trace'."""
  return flags.DEFINE_flag(flags.Flag(DryRunParser(), flags.ArgumentSerializer(), 'dry_run', '', help_text,
                                      boolean=True))
