"""Checkpoint steps: commit protocol, keep the top K (save_top_k by monitor), async save,
resume (NxD Training's exp_manager semantics; choosing and loading the step is in resume.py).

One step on disk (root: a local/shared directory, s3://... or gs://...; the directory name
is step_00000100 or the `filename` template's, see steps.py):

    <root>/step_00000100/arrays/...      the arrays (store.py)
    <root>/step_00000100/metadata.json   format_version, step, the caller's metadata
                                         (consumed_samples, config, layout, the validation
                                         `metrics` a monitor ranks by), every array's global
                                         shape, dtype and chunk shape
    <root>/step_00000100/COMMITTED       the commit marker, written last by rank 0

Commit protocol. A step exists iff its COMMITTED marker exists; there is no rename (object
stores have none), the directory is written in place:
  1. rank 0 deletes every uncommitted step directory (leftovers of a crashed save, including
     an earlier attempt at this very step); all ranks agree before anyone writes.
  2. every rank writes the boxes it owns into its own database; all ranks agree that all
     succeeded (an all-reduce of failure flags: a barrier that also says who failed).
  3. rank 0 merges, verifies every expected array and chunk is there, writes metadata.json,
     then COMMITTED; then prunes: committed steps outside the best `save_top_k` by `monitor`
     (steps.py; the newest with save_last, the step just saved with pin) lose their marker
     first, then their files. All ranks agree again, so every rank raises on failure.
A crash anywhere before COMMITTED leaves a directory without marker, ignored by every query
and deleted by the next save; a crash while pruning leaves a step without marker, likewise.
The previous committed step is never touched before the new one is committed. A committed
step that fails to load on resume is moved aside (`step_N.rejected`), so the resumed run writes
step N afresh. Saving a step
that is already committed is skipped with a warning (resume replays identical state).
One training job per root.

Collectives: the manager needs a process group over all ranks on which it alone runs
collectives - writes run in a background thread, concurrently with the training loop's own
collectives - and with CPU tensors: `dist.new_group(backend='gloo')`. World size 1: none.
Rank 0 decides (what to resume from, whether a step is already committed) and broadcasts,
so all ranks agree even while storage listings lag. `root` must be storage every rank sees
(shared filesystem or object store): rank 0 merges and verifies what all ranks wrote.
"""
import json
import logging
import threading

import torch
import torch.distributed as dist

from checkpoint import resume, save_faults, steps as step_names, storage, store
from checkpoint.steps import MARKER, is_committed, read_metadata
from parallel import device as devices
import user_errors
from user_errors import UserError

FORMAT_VERSION = 1
log = logging.getLogger(__name__)


class IncompatibleCheckpoint(UserError, ValueError):
  """A readable checkpoint that does not fit this run (another model, an unwritable place):
  fatal, never a reason to fall back to an older step."""


class CheckpointManager(resume.Resuming):
  """Saves and restores the steps of one run under `root` (module docstring).

  hook(phase, step), for tests and tracing, is called at: 'waiting' (a save or wait found
  `step` in flight), 'cleaned', 'written' (this rank's arrays are durable), and on rank 0
  'merged', 'metadata', 'committed', 'unmarked' (a pruned step lost its marker), 'pruned'.
  save_top_k: committed steps kept, the best by `monitor` ('step' or a key of the saved
  metadata's `metrics`) in `mode` (steps.to_keep); None or <= 0 keeps all. save_last: the
  newest committed step is kept whatever its rank. filename: the step directory template.
  With async_save, call wait() before the program ends: it raises a failed save's error.
  """

  def __init__(self, root, *, rank=0, world_size=1, group=None, save_top_k=2, monitor='step', mode='max',
               save_last=True, filename=None, async_save=False, hook=None):
    if world_size > 1 and group is None:
      raise ValueError('world_size > 1 needs a process group for the checkpoint collectives')
    if group is not None and dist.get_world_size(group) != world_size:
      raise ValueError(f'the checkpoint group has {dist.get_world_size(group)} ranks, not {world_size}')
    self.root, self.rank, self.world_size, self._group = root, rank, world_size, group
    self.save_top_k, self.monitor, self.mode, self.save_last = save_top_k, monitor, mode, save_last
    self.names, self.async_save = step_names.Names(filename), async_save
    self._values = {}       # step directory name -> its monitored value (metadata.json, read once)
    self._hook = hook or (lambda phase, step: None)
    self._thread, self._in_flight, self._error = None, None, None

  # ---- queries (local listings; no collectives) ----

  def _scan(self, root=None) -> list:
    """[(step, directory name, committed)] of the step directories under `root` (ours by default)."""
    root = root or self.root
    found = []
    for name in storage.list_dir(root):
      step = self.names.parse(name)
      if step is not None:
        found.append((step, name, is_committed(storage.join(root, name))))
    return sorted(found)

  def _committed(self, root=None) -> dict:
    """step -> directory name of each committed step under `root`."""
    return {step: name for step, name, committed in self._scan(root) if committed}

  def step_path(self, step: int, consumed_samples: int = 0) -> str:
    """The directory of committed step `step`, else the one saving it would write."""
    name = self._committed().get(step) or self.names.format(step, consumed_samples)
    return storage.join(self.root, name)

  def committed_steps(self) -> list:
    return sorted(self._committed())

  def latest_committed(self):
    steps = self.committed_steps()
    return steps[-1] if steps else None

  def load(self, step_or_path, requests: dict, dtypes: dict = None):
    """This rank's boxes ({name: box}) of a committed step (number, or path of a step
    directory) -> (arrays, metadata)."""
    path = self.step_path(step_or_path) if isinstance(step_or_path, int) else step_or_path
    if not is_committed(path):
      raise store.CheckpointError(f'{path} is not a committed checkpoint (no {MARKER} marker)')
    return store.load_arrays(path, requests, dtypes), read_metadata(path)

  # ---- save ----

  def save(self, step: int, arrays: dict, layout: dict, metadata: dict = None, pin: bool = False):
    """Save this rank's tensors ({name: local box}; layout: {name: store.ArrayLayout}, the
    same on every rank). Returns once the tensors are copied to host: the caller may then
    change them. Async: the write runs in a background thread; a failure is raised by the
    next save() or wait(). pin: pruning keeps this step whatever its rank."""
    self.wait()
    for name, lay in layout.items():
      store.chunk_shape(lay, name)  # invalid layouts fail here, in the caller's thread
    metadata = metadata or {}
    meta = json.dumps(self._metadata(step, layout, metadata), indent=1)
    name = self.names.format(step, metadata.get('consumed_samples', 0))
    # Only what this rank writes goes to host (replicas written by another rank are skipped).
    # Async must own a copy; sync may read CPU tensors in place, saving host memory.
    mine = [name for name, lay in layout.items() if lay.box_of(self.rank) is not None]
    if missing := sorted(set(mine) - set(arrays)):
      raise ValueError(f'rank {self.rank} writes {missing[:5]} (layout) but was not given them')
    host = devices.to_host({name: arrays[name] for name in mine}, copy=self.async_save)
    if not self.async_save:
      self._write(step, name, host, layout, meta, pin)
      return
    self._in_flight = step
    self._thread = threading.Thread(target=self._write_catching, args=(step, name, host, layout, meta, pin),
                                    name=f'checkpoint-save-{step}')
    self._thread.start()

  def wait(self):
    """Block until the save in flight (if any) is done; raise its error, once."""
    if self._thread is not None:
      if self._thread.is_alive():
        self._hook('waiting', self._in_flight)
      self._thread.join()
      self._thread = None
    error, self._error = self._error, None
    if error is not None:
      raise error

  def _metadata(self, step, layout, metadata):
    if reserved := {'format_version', 'step', 'arrays'} & set(metadata):
      raise ValueError(f'metadata keys {sorted(reserved)} are reserved')
    arrays = {name: {'shape': list(lay.shape), 'dtype': lay.dtype,
                     'chunk_shape': list(store.chunk_shape(lay, name))} for name, lay in sorted(layout.items())}
    return {'format_version': FORMAT_VERSION, 'step': step, **metadata, 'arrays': arrays}

  def _write_catching(self, *args):
    try:
      self._write(*args)
    except BaseException as error:  # pylint: disable=broad-except  (re-raised by wait())
      self._error = error

  def _write(self, step, name, host, layout, meta, pin):
    path, lead = storage.join(self.root, name), self.rank == 0

    def phase(name):
      self._hook(name, step)

    error, already = save_faults.attempt(lambda: self._prepare(step)) if lead else (None, False)
    failed, already = self._agree(error is not None, bool(already))
    save_faults.raise_if(failed, error, f'step {step}: rank 0 could not prepare the save')
    if already:
      log.warning('checkpoint step %d is already committed in %s: not saved again', step, self.root)
      return

    def write_mine():
      phase('cleaned')
      store.write_local(path, host, layout, self.rank)
      host.clear()  # free the host copy before waiting on the slowest rank
      phase('written')
    error = save_faults.disk_fault(save_faults.attempt(write_mine)[0], path)
    [failed] = self._agree(error is not None)
    if failed and lead:         # every rank has stopped writing: the half-written step gives its space back
      self._discard(name)
    save_faults.raise_if(failed, error, f'step {step}: another rank failed to write; not committed')

    def commit():
      store.merge(path, layout)
      phase('merged')
      store.verify(path, layout)
      storage.write_text(path, 'metadata.json', meta)
      self._values.pop(name, None)          # a step written afresh (after a reject) is read anew
      phase('metadata')
      storage.write_text(path, MARKER, json.dumps({'step': step}))
      phase('committed')
      self._prune(step if pin else None)
      phase('pruned')
    error = save_faults.disk_fault(save_faults.attempt(commit)[0], path) if lead else None
    [failed] = self._agree(error is not None)
    if failed and lead and step not in self._committed():
      self._discard(name)
    save_faults.raise_if(failed, error, f'step {step}: rank 0 failed to commit or prune it')

  def _prepare(self, step):
    """Rank 0, before a save: delete stale uncommitted steps; whether `step` is committed
    (under any name: a step replayed after a resume is not saved twice)."""
    self._clean_uncommitted()
    return step in self._committed()

  def _discard(self, name):
    """Delete an uncommitted step after a failed save, where the disk lets us (a read-only one
    does not: the next save's clean-up does it)."""
    try:
      storage.delete_tree(self.root, name + '/')
    except Exception as e:  # pylint: disable=broad-except  (the save's own error is the one to report)
      log.warning('could not delete the uncommitted %s: %s', storage.join(self.root, name), user_errors.describe(e))

  def _clean_uncommitted(self):
    for _, name, committed in self._scan():
      if not committed:
        log.info('deleting uncommitted checkpoint directory %s', storage.join(self.root, name))
        storage.delete_tree(self.root, name + '/')

  def _prune(self, pinned=None):
    if not self.save_top_k or self.save_top_k <= 0:
      return  # keep all (NxDT save_top_k = -1)
    committed = self._committed()
    keep = {pinned} if pinned is not None else set()
    if self.save_last and committed:
      keep.add(max(committed))
    values = {step: step if self.monitor == 'step' else self._value(name) for step, name in committed.items()}
    for step in sorted(set(committed) - step_names.to_keep(values, self.save_top_k, self.mode, keep)):
      storage.delete(storage.join(self.root, committed[step]), MARKER)  # first: a half-deleted step is uncommitted
      self._hook('unmarked', step)
      storage.delete_tree(self.root, committed[step] + '/')

  def _value(self, name):
    """The monitored value recorded in a committed step's metadata (None when absent)."""
    if name not in self._values:
      metrics = read_metadata(storage.join(self.root, name)).get('metrics') or {}
      self._values[name] = metrics.get(self.monitor)
    return self._values[name]

  # ---- collectives over the checkpoint group ----

  def _agree(self, *flags):
    """Every rank's flags, max-reduced (also a barrier)."""
    values = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    if self._group is not None:
      dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group)
    return values.tolist()

  def _share(self, value):
    if self._group is None:
      return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
    return box[0]
