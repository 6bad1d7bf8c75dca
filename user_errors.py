"""Errors a user can cause and fix, and the one way every entry point reports them: one line
on stderr naming the file or setting and the fix, exit status 2, no traceback
(`FLATRON_DEBUG=1`, or train.py's `--debug`, re-raises for the full traceback).

Each reader raises its own kind (a config, a checkpoint, a data file, an HF file, a workdir, a
dead peer); all of them are `UserError`s, so train.py and every tool catch the same set.
Top-level and import-free on purpose: every layer's errors derive from it.
"""
import errno
import os
import re
import sys


class UserError(Exception):
  """A problem with what the user brought (a file, a flag, a setting, the machine), named with
  its fix."""


# What the operating system says, and what the user can do about it.
_OS_FIXES = {
    errno.EACCES: 'check its permissions',
    errno.EPERM: 'check its permissions',
    errno.EROFS: 'the file system is read-only: write somewhere else',
    errno.ENOSPC: 'free space there, or write to a larger disk',
    errno.EISDIR: 'point it at the file, not the directory',
    errno.ENOTDIR: 'a path component is a file, not a directory',
    errno.ENOENT: 'check the path',
    errno.EEXIST: 'remove it or choose another path',
}


def describe(e: BaseException) -> str:
  """The one line for `e`: an OSError names its path, what went wrong and the fix."""
  if isinstance(e, OSError) and e.strerror and not isinstance(e, UserError):
    where = e.filename if e.filename is not None else 'a file'
    fix = _OS_FIXES.get(e.errno)
    return f'{where}: {e.strerror.lower()}' + (f'; {fix}' if fix else '')
  return str(e)


# what C++ libraries append to a message for their own debugging (tensorstore's source locations)
_LIBRARY_NOISE = re.compile(r'\s*\[source locations=.*?\]\s*$', re.S)


def shorten(message: str, limit=400) -> str:
  """A library's error for one line: its source locations dropped and, if still longer than
  `limit`, its middle cut, so both what failed (the start) and why (the end: the errno's
  text, the file) stay."""
  message = _LIBRARY_NOISE.sub('', message)
  if len(message) <= limit:
    return message
  keep = (limit - 5) // 2
  return f'{message[:keep]} ... {message[-keep:]}'


def readable(path):
  """`path`, after opening it once: a file the user may not read, or a directory, fails with the
  operating system's own error (libraries written in Rust or C++ say "No such file" or worse)."""
  with open(path, 'rb'):
    return path


def debugging() -> bool:
  return os.environ.get('FLATRON_DEBUG', '') not in ('', '0')


# A user's error, or the machine's that the user fixes (a permission, a full disk, a file that
# is a directory); MemoryError and FloatingPointError carry train.py's own advice.
CAUSED = (UserError, OSError, MemoryError, FloatingPointError)


def exit_on_error(fn, *args, also=(), debug=False):
  """Calls fn(*args); an error of `CAUSED` (or `also`) ends the process in one line, exit 2."""
  try:
    return fn(*args)
  except CAUSED + tuple(also) as e:
    if debug or debugging():
      raise
    print(f'error: {describe(e)}', file=sys.stderr)
    sys.exit(2)
