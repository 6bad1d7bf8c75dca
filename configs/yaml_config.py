"""Reading NeMo / NxD Training YAML: PyYAML plus the interpolations those configs use.

    read('megatron_llama_7B_config.yaml') -> a plain nested dict, every `${...}` resolved

What OmegaConf resolves in those files, resolved here the same way (OmegaConf is not a
dependency; its semantics are the reference):
  ${a.b.c}          the value at an absolute path (typed: a whole-string reference keeps the
                    referenced value's type; inside a longer string it is formatted in)
  ${.x} / ${..x}    relative to the node holding the key (one dot: a sibling, two: the parent's)
  ${multiply:a,b}   NeMo's registered resolver (a * b), e.g. model_parallel_size
  ${oc.env:VAR}     an environment variable (${oc.env:VAR,default} with a default)
Any other resolver, a missing key or a cycle is a ValueError naming the key and the reference.
YAML 1.1 reads `3e-4` as a string; like OmegaConf, numbers without a dot are floats here.
"""
import os
import re

import yaml


class _Loader(yaml.SafeLoader):
  """SafeLoader whose floats include exponent forms without a dot (1e-5, 3e-4)."""


_Loader.add_implicit_resolver(
    'tag:yaml.org,2002:float',
    re.compile(r'''^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+][0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$''', re.X),
    list('-+0123456789.'))


def _multiply(*args):
  out = 1
  for a in args:
    out *= a
  return out


def _env(name, default=None):
  value = os.environ.get(str(name), None if default is None else str(default))   # strings, as OmegaConf's
  if value is None:
    raise KeyError(f'environment variable {name} is not set')
  return value


RESOLVERS = {'multiply': _multiply, 'oc.env': _env}


def _split_top(text, sep=','):
  """`text` split on `sep` outside ${...}."""
  parts, depth, current = [], 0, ''
  for i, ch in enumerate(text):
    if text.startswith('${', i):
      depth += 1
    elif ch == '}' and depth:
      depth -= 1
    if ch == sep and not depth:
      parts.append(current)
      current = ''
    else:
      current += ch
  return parts + [current]


def _closing(text, start):
  """Index of the '}' closing the '${' at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text.startswith('${', i):
      depth += 1
    elif text[i] == '}':
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f'unclosed interpolation in {text!r}')


class _Resolver:

  def __init__(self, root):
    self.root, self.active = root, []

  def lookup(self, path, where):
    """The resolved value at dotted `path`; relative paths start at `where` (the container path)."""
    if path.startswith('.'):
      dots = len(path) - len(path.lstrip('.'))
      base = where[:len(where) - (dots - 1)] if dots > 1 else where
      keys = list(base) + path[dots:].split('.')
    else:
      keys = path.split('.')
    node = self.root
    for k in keys:
      if isinstance(node, list) and k.isdigit() and int(k) < len(node):
        node = node[int(k)]
      elif isinstance(node, dict) and k in node:
        node = node[k]
      else:
        raise KeyError('.'.join(keys))
    full = '.'.join(keys)
    if full in self.active:
      raise ValueError(f'interpolation cycle: {" -> ".join(self.active + [full])}')
    self.active.append(full)
    try:
      return self.value(node, keys if isinstance(node, dict) else keys[:-1])
    finally:
      self.active.pop()

  def expression(self, expr, where):
    name, colon, args = expr.partition(':')
    if colon and not name.startswith('.') and '${' not in name:
      if name not in RESOLVERS:
        raise ValueError(f'unknown resolver {name!r} in ${{{expr}}}; supported: {", ".join(RESOLVERS)}')
      values = [self.value(yaml.load(a.strip(), _Loader) if '${' not in a else a.strip(), where)
                for a in _split_top(args)] if args.strip() else []
      return RESOLVERS[name](*values)
    return self.lookup(expr.strip(), where)

  def string(self, text, where):
    start = text.find('${')
    if start < 0:
      return text
    end = _closing(text, start)
    value = self.expression(self.string(text[start + 2:end], where), where)
    if start == 0 and end == len(text) - 1:
      return value
    return text[:start] + str(value) + self.string(text[end + 1:], where)

  def value(self, node, where):
    """`node` resolved; `where` is the path of the mapping holding it (of `node` itself when it
    is a mapping), where relative references start."""
    if isinstance(node, dict):
      return {k: self.value(v, where + [k] if isinstance(v, dict) else where) for k, v in node.items()}
    if isinstance(node, list):
      return [self.value(v, where) for v in node]
    if isinstance(node, str):
      return self.string(node, where)
    return node


def resolve(tree):
  """`tree` (nested dicts and lists) with every interpolation resolved."""
  resolver = _Resolver(tree)

  def walk(node, path):
    if isinstance(node, dict):
      return {k: walk(v, path + [k]) for k, v in node.items()}
    if isinstance(node, list):
      return [walk(v, path) for v in node]
    if isinstance(node, str) and '${' in node:
      try:
        return resolver.string(node, path[:-1])
      except KeyError as e:
        raise ValueError(f'{".".join(path)}: {node!r} refers to {e.args[0]!r}, which the file does not set') from None
      except ValueError as e:
        raise ValueError(f'{".".join(path)}: {e}') from None
    return node
  return walk(tree, [])


def read(path):
  """The YAML file at `path` as a nested dict, interpolations resolved."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such YAML file')
  with open(path, encoding='utf-8') as f:
    tree = yaml.load(f, _Loader)
  if not isinstance(tree, dict):
    raise ValueError(f'{path}: expected a mapping of sections at the top, got {type(tree).__name__}')
  return resolve(tree)
