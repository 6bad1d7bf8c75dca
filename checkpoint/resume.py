"""Resuming a run (NxD Training's exp_manager semantics): which committed steps to resume from,
newest first, and loading the first of them that every rank can read, moving a damaged step of
this root aside so the run writes it afresh. A mixin of CheckpointManager (manager.py), which
holds the commit protocol, retention and the collectives these methods use (`wait`, `load`,
`_committed`, `_agree`, `_share`); kept apart because resuming only reads what saving wrote.
"""
import logging

from checkpoint import save_faults, steps as step_names, storage, store
from checkpoint.steps import committed_dirs, is_committed, read_metadata

log = logging.getLogger(__name__)


class Resuming:
  """The resume half of CheckpointManager (module docstring)."""

  def resolve_resume(self, resume_if_exists: bool, resume_ignore_no_checkpoint: bool,
                     resume_from_checkpoint: str = None):
    """Path of the step directory to resume from, or None to start fresh (same on all ranks).

    resume_from_checkpoint (a step directory, or a root holding step directories) wins;
    else with resume_if_exists the newest committed step under `root`; when there is none,
    start fresh if resume_ignore_no_checkpoint, else raise FileNotFoundError."""
    candidates = self.candidates(resume_if_exists, resume_ignore_no_checkpoint, resume_from_checkpoint)
    return candidates[0] if candidates else None

  def resume(self, requests: dict, *, resume_if_exists: bool = False, resume_ignore_no_checkpoint: bool = False,
             resume_from_checkpoint: str = None, dtypes: dict = None, check=None, candidates=None):
    """Load this rank's boxes of the first loadable step of `candidates` (default: resolved
    from the three resume settings, see `candidates`) -> (step, arrays, metadata), or None to
    start fresh. `check(path, metadata)` runs before anything is read; what it raises is fatal.
    A checkpoint that fails to load (checksum, missing array or chunk) on any rank is skipped,
    on all ranks together, for the previous committed one; a rejected step of this root is
    moved aside (`reject`) so that the run writes that step afresh when it gets there."""
    if candidates is None:
      candidates = self.candidates(resume_if_exists, resume_ignore_no_checkpoint, resume_from_checkpoint)
    for path in candidates:
      def load(p=path):
        if check is not None:
          check(p, read_metadata(p))
        return self.load(p, requests, dtypes)
      error, loaded = save_faults.attempt(load)
      corrupt = isinstance(error, store.CheckpointError)
      bad, fatal = self._agree(corrupt, error is not None and not corrupt)
      save_faults.raise_if(fatal, None if corrupt else error, f'loading {path} failed on another rank')
      if not bad:
        arrays, metadata = loaded
        return metadata['step'], arrays, dict(metadata, path=path)
      reason = error if error is not None else 'failed on another rank'
      aside = step_names.reject(self.root, path) if self.rank == 0 else None
      log.warning('checkpoint %s cannot be loaded (%s)%s; falling back to the previous committed step',
                  path, reason, f'; moved it aside to {aside}' if aside else '')
    if candidates:
      raise store.CheckpointError(f'no checkpoint could be loaded; tried {candidates}')
    return None

  def candidates(self, resume_if_exists, resume_ignore_no_checkpoint, resume_from_checkpoint):
    """Step paths to resume from, newest first; [] to start fresh (rank 0 lists, everyone gets
    its answer or error). resume_from_checkpoint (a step directory, or a root holding step
    directories) wins; else with resume_if_exists the committed steps under `root`; when there
    are none, start fresh if resume_ignore_no_checkpoint, else raise FileNotFoundError."""
    self.wait()

    def lead():
      if resume_from_checkpoint:
        if is_committed(resume_from_checkpoint):
          return [resume_from_checkpoint]
        steps = committed_dirs(resume_from_checkpoint)
        if not steps:
          raise FileNotFoundError(f'resume_from_checkpoint={resume_from_checkpoint!r} is neither a '
                                  'committed checkpoint step nor a directory holding one')
        return [storage.join(resume_from_checkpoint, steps[s]) for s in sorted(steps, reverse=True)]
      if not resume_if_exists:
        return []
      steps = self._committed()
      if not steps and not resume_ignore_no_checkpoint:
        raise FileNotFoundError(f'resume_if_exists: no committed checkpoint in {self.root}; to '
                                'start fresh, set --config.exp_manager.resume_ignore_no_checkpoint=True '
                                '(or resume_if_exists=False)')
      if not steps:
        log.warning('resume_if_exists: no committed checkpoint in %s; starting fresh', self.root)
      return [storage.join(self.root, steps[s]) for s in sorted(steps, reverse=True)]
    error, candidates = save_faults.attempt(lead) if self.rank == 0 else (None, None)
    error, candidates = self._share((error, candidates))
    if error is not None:
      raise error
    return candidates
