"""How a save's failures are said (checkpoint/manager.py): each rank's error kept until the ranks
have agreed on it, and a full, read-only or forbidden disk named as such with its fix."""
import errno
import re

from checkpoint.store import CheckpointError

# What the disk says (Python's errno; tensorstore's ValueError text), said as such, with the fix.
DISK_FAULTS = ((errno.ENOSPC, 'No space left on device', 'no space left on',
                'free space there, or set exp_manager.checkpoint_dir to a larger disk'),
               (errno.EROFS, 'Read-only file system', 'a read-only file system at',
                'make it writable, or set exp_manager.checkpoint_dir to a writable disk'),
               (errno.EACCES, 'Permission denied', 'permission denied writing',
                'check its permissions, or set exp_manager.checkpoint_dir to a directory you can write'))


# tensorstore names the operating system's errno in its message
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")


def disk_fault(error, path):
  """A full, read-only or forbidden disk during a save said as such (tensorstore reports it as a
  ValueError whose text holds the errno, Python as an OSError), from the whole of the error and
  what caused it; other errors pass through."""
  chain = []
  while error is not None and len(chain) < 8 and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  codes = {getattr(e, 'errno', None) for e in chain} | {int(c) for e in chain for c in _OS_ERROR_CODE.findall(str(e))}
  for code, text, said, fix in DISK_FAULTS:
    if code in codes or any(text in str(e) for e in chain):
      return CheckpointError(f'{said} {path}: this step is not committed and the last committed step is kept; {fix}')
  return chain[0] if chain else None


def raise_if(failed, error, message):
  """After an agreement: this rank's own error, else a generic one if another rank failed."""
  if error is not None:
    raise error
  if failed:
    raise CheckpointError(message)


def attempt(fn):
  """(error, None) or (None, result): errors wait until all ranks have agreed on them."""
  try:
    return None, fn()
  except Exception as error:  # pylint: disable=broad-except
    return error, None
