"""What the demo tools (prepare_demo, sft_demo, dpo_demo) share: `--data-dir` and `--report`,
and a main that prepares the demo's data (each step skipped when done), then prints either
the train.py flags (stdout holds nothing else, so a Makefile can splice them in) or a finished
run's report."""
import sys

from absl import flags

import tools

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string('data-dir', '.data', 'Downloads, models and prepared data go here.')
  flags.DEFINE_string('report', None, 'A finished run\'s workdir: print its result instead of the train.py flags.')


def main(argv, prepare, report):
  """`prepare(data_dir)` gives the train.py flags; `report(workdir, data_dir)` the run's result."""
  tools.no_arguments(argv)
  data_dir = FLAGS['data-dir'].value
  train_flags = prepare(data_dir)
  print(report(FLAGS.report, data_dir) if FLAGS.report else ' '.join(train_flags))


def logger(name):
  """The tool's progress log: stderr, so that stdout stays the flags."""
  return lambda msg: print(f'[{name}] {msg}', file=sys.stderr, flush=True)
