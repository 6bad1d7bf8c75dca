"""NxD Training checkpoints on disk, read without torch-xla or the NxD package.

A checkpoint is a tag directory (NxD Training names it after Lightning's file name, e.g.
`hf_llama3_8B--step=5-consumed_samples=160.0.ckpt/`; NxD's checkpoint_converter.py writes only
its model/ folder, into --output_dir) holding
  checkpoint, done                 markers: `done` is written last, by rank 0, once every rank saved;
                                   it picks the newest finished tag of a run, while a tag named
                                   itself is read without it, as NxD's load_checkpoint reads a tag
  model/dp_rank_00[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt    one state dict per (ep, tp, pp) rank:
                                   that rank's shards under the module's global names
  optim/dp_rank_DD[_ep_rank_EE]_tp_rank_TT_pp_rank_PP.pt    its optimizer state
  user_content.pt                  Lightning's checkpoint dict without the weights (global_step, ...)
or, in NxD's first layout, tp_rank_TT_pp_rank_PP/checkpoint.pt ({'model': state dict, ...}).
A file is plain `torch.save`, or xser: the pickle holds `TensorReference(tid)` objects and each
tensor is `<file>.tensors/tensor_<tid>.pt` (with expert parallelism the non-expert tensors are
stored only under the ep_rank_00 file's folder). Everything is unpickled by torch's weights-only
loader with two stand-in classes for the references, never by plain pickle; user_content.pt by
an unpickler that builds nothing but containers, numbers, strings and tensors (any other class
becomes an inert record of its arguments).
"""
import dataclasses
import os
import pickle
import re

import torch
from user_errors import UserError

RANK_FILE = re.compile(r'^dp_rank_(\d+)(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$')
LEGACY_RANK = re.compile(r'^tp_rank_(\d+)_pp_rank_(\d+)$')
TAG_PROGRESS = re.compile(r'step=(\d+)(?:-consumed_samples=(\d+(?:\.\d+)?))?')


class NxDCheckpointError(UserError, ValueError):
  """An NxD checkpoint that cannot be read as it is: the message names the file and the fix."""


class TensorReference:
  """Stand-in for torch_xla.utils.serialization.TensorReference (state: tid)."""


class InternalTensorReference:
  """Stand-in for neuronx_distributed.trainer.checkpoint._InternalTensorReference."""


REFERENCES = [(TensorReference, 'torch_xla.utils.serialization.TensorReference'),
              (InternalTensorReference, 'neuronx_distributed.trainer.checkpoint._InternalTensorReference')]


@dataclasses.dataclass
class Tag:
  """One NxD checkpoint: its directory, model rank files by (ep, tp, pp), and degrees."""
  path: str
  files: dict
  tp: int
  pp: int
  ep: int
  legacy: bool = False

  @property
  def name(self):
    return os.path.basename(os.path.normpath(self.path))


def is_tag(path) -> bool:
  return os.path.isdir(os.path.join(path, 'model')) or any(
      LEGACY_RANK.match(n.removesuffix('.tensors')) for n in _listdir(path))


def is_nxd_checkpoint(path) -> bool:
  """Whether `path` is an NxD tag directory or a directory of them."""
  return os.path.isdir(path) and (is_tag(path) or any(is_tag(os.path.join(path, n)) for n in _listdir(path)))


def find_tag(path) -> str:
  """`path` when it is a tag (named, so read as it is: NxD's converter writes no `done`); else
  the newest tag in it that has its `done` marker (a run's tags: one without it is a save that
  did not finish)."""
  if not os.path.isdir(path):
    raise NxDCheckpointError(f'{path}: no such directory (an NxD checkpoint is a tag directory holding model/)')
  if is_tag(path):
    return path
  tags = [os.path.join(path, n) for n in _listdir(path) if is_tag(os.path.join(path, n))]
  done = [t for t in tags if os.path.exists(os.path.join(t, 'done'))]
  if not done:
    raise NxDCheckpointError(f'{path}: no NxD checkpoint tag with a `done` marker in it'
                             + (f' ({len(tags)} unfinished: {", ".join(sorted(map(os.path.basename, tags)))}; '
                                'to read one whose save did finish as it is, name its directory)' if tags else ''))
  return max(done, key=lambda t: (_progress_from_name(t)[0], os.path.getmtime(os.path.join(t, 'done'))))


def open_tag(path) -> Tag:
  """The tag at (or newest finished in) `path`, checked: every rank file present. A tag named
  itself needs no `done` (NxD's converter output has none); its rank files and tensors are
  checked as any tag's, and a cut-short file fails to unpickle."""
  path = find_tag(path)
  files, legacy = {}, False
  model_dir = os.path.join(path, 'model')
  if os.path.isdir(model_dir):
    for n in _listdir(model_dir):
      m = RANK_FILE.match(n.removesuffix('.tensors'))
      if m and not n.endswith('.tensors'):
        files[(int(m.group(2) or 0), int(m.group(3)), int(m.group(4)))] = os.path.join(model_dir, n)
      elif m and not os.path.exists(os.path.join(model_dir, n.removesuffix('.tensors'))):
        raise NxDCheckpointError(f'{path}: missing rank file model/{n.removesuffix(".tensors")} (its tensors are there); '
                                 'copy the whole tag directory')
  else:
    legacy = True
    for n in _listdir(path):
      m = LEGACY_RANK.match(n)
      if m:
        inner = os.path.join(path, n, 'checkpoint.pt')
        files[(0, int(m.group(1)), int(m.group(2)))] = inner if os.path.isdir(os.path.join(path, n)) else os.path.join(path, n)
  if not files:
    raise NxDCheckpointError(f'{path}: no model rank files (model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt)')
  ep, tp, pp = (max(k[i] for k in files) + 1 for i in range(3))
  for key in ((e, t, p) for e in range(ep) for t in range(tp) for p in range(pp)):
    if key not in files:
      raise NxDCheckpointError(f'{path}: missing rank file {rank_name(legacy, ep > 1, *key)} (the others say tp={tp}, pp={pp}'
                               f'{f", ep={ep}" if ep > 1 else ""}); copy the whole tag directory')
  return Tag(path, files, tp, pp, ep, legacy)


def rank_name(legacy, ep_named, ep, tp, pp) -> str:
  """Model rank (ep, tp, pp)'s file, relative to the tag directory, as NxD names it (`ep_named`:
  the names carry ep_rank, as they do when ep > 1)."""
  if legacy:
    return f'tp_rank_{tp:02d}_pp_rank_{pp:02d}'
  return f'model/dp_rank_00{f"_ep_rank_{ep:02d}" if ep_named else ""}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt'


def load(file, ep_zero=None) -> dict:
  """A rank file's contents, xser references resolved (`ep_zero`: the ep_rank_00 file, whose
  folder holds the tensors an ep_rank_EE file shares)."""
  if not os.path.exists(file):
    raise NxDCheckpointError(f'{file}: missing')
  try:
    with torch.serialization.safe_globals(REFERENCES):
      data = torch.load(file, map_location='cpu', weights_only=True)
  except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
    raise NxDCheckpointError(f'{file}: not a readable NxD checkpoint file ({str(e).splitlines()[0][:200]}); '
                             'it may be truncated: copy it again from the source') from e
  return _resolve(data, file, ep_zero)


def read_rank(tag: Tag, ep, tp, pp) -> dict:
  """The state dict of model rank (ep, tp, pp): name -> tensor (this rank's shard)."""
  file = tag.files[(ep, tp, pp)]
  data = load(file, tag.files[(0, tp, pp)] if ep else None)
  if tag.legacy and isinstance(data, dict) and 'model' in data:
    data = data['model']
  if not isinstance(data, dict) or not all(torch.is_tensor(v) for v in data.values()):
    raise NxDCheckpointError(f'{file}: expected a state dict (name -> tensor), found {type(data).__name__}')
  return data


def progress(tag: Tag) -> dict:
  """{'step', 'consumed_samples'} as NxD Training resumes them: the step from user_content.pt's
  global_step (else the tag name), the consumed samples from the tag name; plus user_content's
  Lightning lr scheduler states when present."""
  step, consumed = _progress_from_name(tag.path)
  out = {'step': step, 'consumed_samples': consumed, 'lr_schedulers': None}
  content = os.path.join(tag.path, 'user_content.pt')
  if os.path.exists(content):
    data = torch.load(content, map_location='cpu', weights_only=False, pickle_module=_inert_pickle)
    if isinstance(data, dict):
      out['step'] = int(data.get('global_step', step) if data.get('global_step') is not None else step)
      out['lr_schedulers'] = data.get('lr_schedulers')
  return out


# --- helpers ---------------------------------------------------------------------------------


def _listdir(path):
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _progress_from_name(path):
  """(step, consumed samples or None) from NxD Training's tag name (...--step=S-consumed_samples=C.ckpt)."""
  m = TAG_PROGRESS.search(os.path.basename(os.path.normpath(path)))
  if not m:
    return 0, None
  return int(m.group(1)), (int(float(m.group(2))) if m.group(2) else None)


def _resolve(data, file, ep_zero):
  """`data` with every TensorReference replaced by its tensor file."""
  folders = [file + '.tensors'] + ([ep_zero + '.tensors'] if ep_zero else [])

  def tensor(tid):
    for folder in folders:
      path = os.path.join(folder, f'tensor_{tid}.pt')
      if os.path.exists(path):
        try:
          return torch.load(path, map_location='cpu', weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
          raise NxDCheckpointError(f'{path}: unreadable xser tensor ({str(e).splitlines()[0][:160]}); it may be '
                                   'truncated: copy the tag again from the source') from e
    raise NxDCheckpointError(f'{file}: its xser tensor {tid} is missing (looked in {", ".join(folders)}); '
                             'copy the whole tag directory, .tensors folders included')

  def walk(x):
    if isinstance(x, (TensorReference, InternalTensorReference)):
      return tensor(x.tid)
    if isinstance(x, dict):
      return {k: walk(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return type(x)(walk(v) for v in x)
    return x

  return walk(data)


class _Inert:
  """What user_content.pt's other classes become: their arguments and state, nothing run."""

  def __init__(self, *args, **kwargs):
    self.args, self.kwargs = args, kwargs

  def __setstate__(self, state):
    self.state = state


class _InertUnpickler(pickle.Unpickler):
  SAFE = {('collections', 'OrderedDict'), ('builtins', 'set'), ('builtins', 'frozenset'), ('builtins', 'slice'),
          ('torch', 'Size'), ('torch._utils', '_rebuild_tensor_v2'), ('torch._utils', '_rebuild_parameter'),
          ('torch', 'device')}

  def find_class(self, module, name):
    if (module, name) in self.SAFE or (module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype)) \
        or (module == 'torch' and name.endswith('Storage')):
      return super().find_class(module, name)
    return type(name, (_Inert,), {'__module__': 'nxd_inert.' + module})


class _inert_pickle:  # pylint: disable=invalid-name
  """A pickle module for torch.load whose unpickler builds no arbitrary classes."""
  Unpickler = _InertUnpickler
  load = pickle.load
  __name__ = 'nxd_inert_pickle'
