"""The committed steps of a checkpoint root: what their directories are called, how a step is
marked committed and described (metadata.json), which of them pruning keeps (NxD Training's
checkpoint_callback_params), and how a step that fails to load is moved aside.

Names. `exp_manager.checkpoint_callback_params.filename` is a Python format string with the
fields {step} (required) and {consumed_samples}, e.g. 'megatron_llama--{step}-{consumed_samples}'
-> megatron_llama--100-800; None keeps step_00000100. A directory is a step when its name
matches the template (or the default form, so a run may change its template and still find
its earlier steps); the step number is read back from the name. (Lightning's
auto_insert_metric_name would write step=100; these are plain Python format fields.)

Keeping. save_top_k steps are kept, ranked by `monitor` ('step', or a key of the validation
record such as val_loss, stored in each step's metadata.json) in `mode` ('max': the highest
values are best; 'min': the lowest). Ties go to the newer step. A step with no value recorded
for the monitor (saved by a run that monitored something else; or NaN) ranks below every step
that has one. `pinned` steps (the newest with save_last, a stop's save) are kept whatever
their rank. save_top_k <= 0 (NxD's -1) keeps every step.
"""
import json
import math
import os
import re
import string

from checkpoint import storage, store
from config_checks import one_of, positive
from model import objectives

MARKER = 'COMMITTED'
_REJECTED = re.compile(r'\.rejected\d*$')       # steps moved aside by `reject` keep their marker
DEFAULT_TEMPLATE = 'step_{step:08d}'
FIELDS = ('step', 'consumed_samples')
_SPEC = re.compile(r'0?\d*d?')          # '', 'd', '08d': decimal integers, so names parse back
MODES = ('min', 'max')


def template_problems(template, key='exp_manager.checkpoint_callback_params.filename') -> list:
  """What is wrong with a step directory template, as messages naming `key` and the fix."""
  try:
    parts = list(string.Formatter().parse(template))
  except ValueError as e:
    return [f'{key}={template!r} is not a format string ({e}); e.g. \'megatron_llama--{{step}}-{{consumed_samples}}\'']
  problems, fields = [], [field for _, field, _, _ in parts if field is not None]
  if '/' in template:
    problems.append(f'{key}={template!r} holds a "/"; it names one directory under the checkpoint root')
  if unknown := sorted({f for f in fields if f not in FIELDS}):
    problems.append(f'{key}={template!r} has field(s) {unknown}; only {{step}} and {{consumed_samples}} are filled in')
  if fields.count('step') != 1:
    problems.append(f'{key}={template!r} must hold {{step}} exactly once: the step is read back from the name')
  for _, field, spec, conversion in parts:
    if field is not None and (conversion or not _SPEC.fullmatch(spec or '')):
      problems.append(f'{key}={template!r}: {{{field}}} may only carry an integer width such as '
                      f'{{{field}:08d}}')
  for (_, first, _, _), (literal, second, _, _) in zip(parts, parts[1:]):
    if first is not None and second is not None and not literal:
      problems.append(f'{key}={template!r}: put a separator between {{{first}}} and {{{second}}} '
                      'so the step can be read back')
  return problems


def check(config) -> list:
  """Problems with exp_manager.checkpoint_callback_params (what is kept, ranked by what, under
  which names) and the run's names (config.name, exp_manager.name: directories)."""
  e, key = config.exp_manager, 'exp_manager.checkpoint_callback_params'
  p, problems = e.checkpoint_callback_params, []
  if p.save_top_k == 0 or p.save_top_k < -1:
    problems.append(f'{key}.save_top_k={p.save_top_k} must be > 0 (steps kept) or -1 (keep all)')
  positive(problems, f'{key}.every_n_train_steps', p.every_n_train_steps, allow_zero=True)
  for name_key, name in (('name', config.name), ('exp_manager.name', e.name)):
    if name is not None and (not name or '/' in name):
      problems.append(f'{name_key}={name!r} names a directory (TensorBoard, exp_dir/<name>): use a '
                      'non-empty name without "/"')
  try:
    metrics = objectives.for_config(config).metrics
  except ValueError:
    metrics = ()                        # an unknown objective is objectives.check's to report
  one_of(problems, f'{key}.monitor', p.monitor, ('step', 'val_loss') + tuple(f'val_{m}' for m in metrics))
  one_of(problems, f'{key}.mode', p.mode, MODES)
  if p.monitor != 'step' and config.trainer.limit_val_batches <= 0:
    problems.append(f'{key}.monitor={p.monitor!r} ranks steps by validation, but trainer.limit_val_batches='
                    f'{config.trainer.limit_val_batches}; raise limit_val_batches or monitor \'step\'')
  if p.filename is not None:
    problems += template_problems(p.filename, f'{key}.filename')
  return problems


def _pattern(template):
  """The regex of a template's directory names, with the step as group 'step'."""
  out = ''
  for literal, field, _, _ in string.Formatter().parse(template):
    out += re.escape(literal)
    if field is not None:
      out += r'(?P<step>\d+)' if field == 'step' else r'\d+'
  return re.compile(out)


class Names:
  """Step directory names: format(step, consumed_samples) and parse(name) -> step or None."""

  def __init__(self, template=None):
    self.template = template or DEFAULT_TEMPLATE
    if problems := template_problems(self.template):
      raise ValueError(problems[0])
    self._patterns = [_pattern(t) for t in dict.fromkeys((self.template, DEFAULT_TEMPLATE))]

  def format(self, step, consumed_samples=0) -> str:
    return self.template.format(step=int(step), consumed_samples=int(consumed_samples))

  def parse(self, name):
    for pattern in self._patterns:
      if match := pattern.fullmatch(name):
        return int(match.group('step'))
    return None


def _missing(value):
  return not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value)


def to_keep(values: dict, top_k, mode='max', pinned=()) -> set:
  """The steps to keep of `values` (step -> the monitored value, None when not recorded): the
  best `top_k` by `mode`, ties to the newer, plus `pinned`; all when top_k is None or <= 0."""
  if top_k is None or top_k <= 0:
    return set(values)
  sign = -1.0 if mode == 'max' else 1.0

  def rank(step):                        # smaller is better
    value = values[step]
    return (1, 0.0, -step) if _missing(value) else (0, sign * value, -step)
  return set(sorted(values, key=rank)[:top_k]) | (set(pinned) & set(values))


def step_dir(step: int) -> str:
  """The default directory name of a step (no filename template)."""
  return Names().format(step)


def read_metadata(step_path: str) -> dict:
  try:
    text = storage.read_text(step_path, 'metadata.json')
  except UnicodeDecodeError as e:
    raise store.ChecksumError(f'{step_path}/metadata.json: not UTF-8 text (byte {e.start}): the step is damaged; use '
                              'an earlier one (resume moves it aside and takes the one before)') from None
  if text is None and not storage.is_remote(step_path) and not os.path.isdir(step_path):
    raise store.CheckpointError(f'{step_path} is a file, not a checkpoint step directory' if os.path.exists(step_path)
                                else f'{step_path} does not exist')
  if text is None:
    raise store.CheckpointError(f'{step_path} has no metadata.json (not a flatron checkpoint step)')
  try:
    meta = json.loads(text)
  except json.JSONDecodeError as e:
    raise store.ChecksumError(f'{step_path}/metadata.json: not valid JSON at line {e.lineno} column {e.colno} '
                              f'({e.msg}): the step is damaged; use an earlier one (resume moves it aside and takes the one before)') from None
  if not isinstance(meta, dict):
    raise store.ChecksumError(f'{step_path}/metadata.json: expected a JSON object, found {type(meta).__name__}')
  return meta


def is_committed(step_path: str) -> bool:
  return storage.exists(step_path, MARKER)


def committed_dirs(root: str) -> dict:
  """step -> directory name of every committed step under `root`, whatever its naming (the
  marker records the step): for a root of another run, or a tool given a run's checkpoints."""
  found = {}
  for name in storage.list_dir(root):
    text = None if _REJECTED.search(name) else storage.read_text(storage.join(root, name), MARKER)
    if text:
      found[json.loads(text)['step']] = name
  return found


def reject(root, path):
  """Take a corrupt committed step of `root` out of the run (its data kept for
  inspection where the storage can rename). -> where it went, or None."""
  if not path.startswith(root.rstrip('/') + '/'):
    return None                  # a step the user named elsewhere: leave it alone
  if storage.is_remote(path):    # object stores cannot rename: un-commit it (cleaned at next save)
    storage.write_text(path, 'REJECTED', 'failed to load on resume')
    storage.delete(path, MARKER)
    return path + ' (uncommitted)'
  local = storage.kvstore_spec(path)['path'].rstrip('/')
  target, n = local + '.rejected', 1
  while os.path.exists(target):
    target, n = f'{local}.rejected{n}', n + 1
  os.rename(local, target)
  return target
