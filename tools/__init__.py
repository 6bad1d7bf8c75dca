"""The command-line tools, each run from the repository root as `python -m tools.<name>`
(`--help` lists its flags).

Every tool defines its absl flags in `define_flags()`, called only under
`if __name__ == '__main__':`, so importing a tool (other tools and the tests do) defines no
flag and none clashes with train.py's or another tool's. What tests and other tools call takes
plain arguments and never reads FLAGS.
"""
import signal
import sys

from absl import flags


def fail(message):
  """Ends a tool whose command line cannot run: one line on stderr naming the fix, exit status 2
  (as train.py's user errors)."""
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def no_arguments(argv):
  if len(argv) > 1:
    fail(f'unexpected arguments {" ".join(argv[1:])}: this tool takes flags only (--help lists them)')


def exit_on_sigterm():
  """SIGTERM (`timeout`, a scheduler, `kill`) ends the tool as Ctrl-C does, through its `finally`
  blocks: a tool whose children run in their own process group kills them there, so none
  outlives it (Python's default SIGTERM exits without running them)."""
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def define_list_of(name, default, choices, help_text):
  """A comma-separated flag whose every item is one of `choices`."""
  flags.DEFINE_list(name, default, f'{help_text} (of {", ".join(choices)}).')
  flags.register_validator(name, lambda items: set(items) <= set(choices),
                           f'--{name} takes a comma-separated list of {", ".join(choices)}')
