"""Reading NeMo / NxD Training YAML with OmegaConf, the library those projects resolve it with.

    read('megatron_llama_7B_config.yaml') -> a plain nested dict, every `${...}` resolved

So every interpolation means here what it means there: `${a.b.c}`, relative `${.x}` / `${..x}`,
`${a[0]}`, escapes, `oc.env`, `oc.select`, and NeMo's `multiply` resolver (registered below
as NeMo registers it). OmegaConf's YAML loader also reads `3e-4` as a float, as NeMo sees it.
A missing key, a cycle or an unknown resolver is a ValueError naming the key and the reference.
"""
import os

import omegaconf
from omegaconf import OmegaConf


def _multiply(*args):
  out = 1
  for a in args:
    out *= a
  return out


if not OmegaConf.has_resolver('multiply'):
  OmegaConf.register_resolver('multiply', _multiply)    # typed arguments (2.4; 2.3's name: register_new_resolver)


def read(path):
  """The YAML file at `path` as a nested dict, interpolations resolved."""
  if os.path.isdir(path):
    raise ValueError(f'{path}: is a directory; name the YAML file in it')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such YAML file')
  try:
    tree = OmegaConf.load(path)
  except OSError:
    raise           # said by user_errors.describe: permission denied, ...
  except Exception as e:  # pylint: disable=broad-except   (yaml's and OmegaConf's parse errors)
    mark = getattr(e, 'problem_mark', None)             # PyYAML's position of the problem
    where = f' at line {mark.line + 1} column {mark.column + 1}' if mark is not None else ''
    problem = '; '.join(p for p in (getattr(e, 'context', None), getattr(e, 'problem', None)) if p) \
        or str(e).splitlines()[0]
    raise ValueError(f'{path}: not valid YAML{where}: {problem}') from None
  if not isinstance(tree, omegaconf.DictConfig):
    raise ValueError(f'{path}: expected a mapping of sections at the top, got a list')
  if not tree:    # an emptied file would train the defaults, silently
    raise ValueError(f'{path}: is empty; it may have been emptied or cut short: copy it again')
  try:
    return OmegaConf.to_container(tree, resolve=True)
  except omegaconf.errors.OmegaConfBaseException as e:
    key = getattr(e, 'full_key', None) or '?'
    what = str(e).split('\n', 1)[0]
    if isinstance(e, omegaconf.errors.InterpolationKeyError):
      what = f'refers to a key the file does not set ({what})'
    elif 'recursive' in what.lower():
      what = f'interpolation cycle ({what})'
    raise ValueError(f'{path}: {key}: {what}') from None
