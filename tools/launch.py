"""Start torchrun on this node with the node count, node rank and rendezvous host that SLURM,
OpenMPI or plain variables give: one launcher per node, torchrun starts the ranks.

  python -m tools.launch [--nproc_per_node=N] [--dry_run] [overrides] -- train.py <train flags>

SLURM: one launcher per node under srun (the master is the first host of the node list,
expanded here: node[001-004,007] -> node001; no scontrol needed):

  #!/bin/bash
  #SBATCH --nodes=2
  #SBATCH --ntasks-per-node=1          # one launcher per node; torchrun starts the 32 ranks
  #SBATCH --exclusive
  srun python -m tools.launch --nproc_per_node=32 -- \\
      train.py --config=configs/nxd_yaml.py:my.yaml --workdir=runs/my

OpenMPI (MPI on EKS sets MASTER_ADDR itself; elsewhere export it to every node with -x):

  mpirun -np 2 --map-by ppr:1:node -x MASTER_ADDR=node001 -x MASTER_PORT=29500 \\
      python -m tools.launch --nproc_per_node=32 -- train.py --config=... --workdir=...

Where each setting comes from, first found wins (a flag always beats the environment):

  setting         flag              OpenMPI                SLURM                          plain
  nodes           --nnodes          OMPI_COMM_WORLD_SIZE   SLURM_STEP_NUM_NODES,          NNODES
                                                           SLURM_JOB_NUM_NODES, SLURM_NNODES
  node rank       --node_rank       OMPI_COMM_WORLD_RANK   SLURM_NODEID                   NODE_RANK
  master host     --master_addr     MASTER_ADDR            first host of SLURM_STEP_NODELIST,
                                                           SLURM_JOB_NODELIST, SLURM_NODELIST;
                                                           else MASTER_ADDR               MASTER_ADDR
  master port     --master_port     MASTER_PORT, else 29500 (every source)
  rendezvous id   --rdzv_id         SLURM_JOB_ID under SLURM, else 'flatron'
  ranks per node  --nproc_per_node  NPROC_PER_NODE, else 1 (every source)

OpenMPI is checked first: mpirun inside a SLURM allocation sets both, and only OMPI_* describe
the launchers. Under SLURM the node list beats MASTER_ADDR because sbatch exports the
submitting shell's environment, where a stale MASTER_ADDR=localhost would split the job. The
step's variables beat the job's so that `srun -N2` inside a larger allocation is two nodes.
Ranks per node default to 1, not to a device count: nothing here knows the accelerator, so
say --nproc_per_node (or NPROC_PER_NODE) for all but a one-rank-per-node world.

More than one node: `torchrun --nnodes=N --nproc_per_node=P --rdzv_backend=c10d
--rdzv_endpoint=HOST:PORT --rdzv_id=ID`; the c10d store is served by whichever launcher runs
on HOST, so nodes may start in any order. The node rank is checked (below the node count) and
reported but not passed: torchrun ignores --node_rank under c10d, and warns that it does.
One node: `torchrun --standalone --nproc_per_node=P`, which needs no host or port.

--dry_run prints the command and exits; otherwise the command goes to stderr and this process
becomes torchrun (exec), so the scheduler's signals reach it directly. Inconsistent input (a
node rank not below the node count, a node list it cannot read, no master host for several
nodes, several launchers on one node) is one line naming the variable and the fix, exit 2.
"""
import dataclasses
import itertools
import os
import re
import shlex
import sys

from absl import app, flags

import tools
import user_errors

FLAGS = flags.FLAGS
DEFAULT_PORT = 29500
DEFAULT_RDZV_ID = 'flatron'

SLURM_NNODES = ('SLURM_STEP_NUM_NODES', 'SLURM_JOB_NUM_NODES', 'SLURM_NNODES')
SLURM_NODELIST = ('SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST', 'SLURM_NODELIST')


class LaunchError(user_errors.UserError, ValueError):
  """Settings that cannot start a job; the message names the variable and the fix."""


@dataclasses.dataclass(frozen=True)
class Settings:
  nnodes: int
  node_rank: int
  nproc_per_node: int
  master_addr: str | None
  master_port: int
  rdzv_id: str
  source: str                   # 'OpenMPI', 'SLURM' or 'env': which scheduler was read


def expand_nodelist(nodelist):
  """Slurm's compressed host list as host names, in order: 'node[001-002,7],x' -> node001,
  node002, node7, x. Zero padding follows the range's first number; several bracket groups in
  one name give every combination. ValueError says what is wrong."""
  hosts = []
  for name in _split_outside_brackets(nodelist):
    pieces = re.split(r'\[([^\]]*)\]', name)   # text, group, text, group, ..., text
    if not name:
      raise ValueError('empty host name')
    if any(c in text for text in pieces[::2] for c in '[]'):
      raise ValueError(f'cannot read host {name!r}')
    groups = [_expand_ranges(group) for group in pieces[1::2]]
    for combination in itertools.product(*groups):
      parts = [p for pair in itertools.zip_longest(pieces[::2], combination, fillvalue='') for p in pair]
      hosts.append(''.join(parts))
  return hosts


def _split_outside_brackets(nodelist):
  names, depth, start = [], 0, 0
  for i, c in enumerate(nodelist):
    depth += {'[': 1, ']': -1}.get(c, 0)
    if depth not in (0, 1):
      raise ValueError('unbalanced brackets')
    if c == ',' and depth == 0:
      names.append(nodelist[start:i])
      start = i + 1
  if depth:
    raise ValueError('unbalanced brackets')
  return names + [nodelist[start:]]


def _expand_ranges(group):
  out = []
  for item in group.split(','):
    m = re.fullmatch(r'(\d+)(?:-(\d+))?', item)
    if not m or (m[2] is not None and int(m[2]) < int(m[1])):
      raise ValueError(f'cannot read range {item!r} in [{group}]')
    lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
    out.extend(str(n).zfill(len(m[1])) for n in range(lo, hi + 1))
  return out


def _first(env, names):
  """(name, value) of the first of `names` set to something, or (None, None)."""
  return next(((n, env[n]) for n in names if env.get(n)), (None, None))


def _int(value, origin, minimum, fix):
  try:
    n = int(value)
  except (TypeError, ValueError):
    n = None
  if n is None or n < minimum:
    raise LaunchError(f'{origin}={value!r} is not an integer >= {minimum}: {fix}')
  return n


def _from_env(env):
  """{setting: (value, origin)} from the scheduler's variables; origin names the variable."""
  found = {}

  def take(key, names):
    name, value = _first(env, names)
    if name:
      found[key] = (value, name)

  if env.get('OMPI_COMM_WORLD_SIZE'):
    source = 'OpenMPI'
    take('nnodes', ['OMPI_COMM_WORLD_SIZE'])
    take('node_rank', ['OMPI_COMM_WORLD_RANK'])
    take('master_addr', ['MASTER_ADDR'])
    per_node = env.get('OMPI_COMM_WORLD_LOCAL_SIZE', '1')
    if per_node != '1':
      raise LaunchError(f'OMPI_COMM_WORLD_LOCAL_SIZE={per_node}: start one launcher per node '
                        '(mpirun --map-by ppr:1:node) and the ranks per node with --nproc_per_node')
  elif env.get('SLURM_JOB_ID'):
    source = 'SLURM'
    take('nnodes', SLURM_NNODES)
    take('node_rank', ['SLURM_NODEID'])
    take('rdzv_id', ['SLURM_JOB_ID'])
    name, nodelist = _first(env, SLURM_NODELIST)
    if name:
      try:
        found['master_addr'] = (expand_nodelist(nodelist)[0], name)
      except ValueError as e:
        raise LaunchError(f'{name}={nodelist!r} is not a Slurm node list ({e}): pass the first '
                          'node with --master_addr=HOST') from None
    else:
      take('master_addr', ['MASTER_ADDR'])
  else:
    source = 'env'
    take('nnodes', ['NNODES'])
    take('node_rank', ['NODE_RANK'])
    take('master_addr', ['MASTER_ADDR'])
  take('master_port', ['MASTER_PORT'])
  take('nproc_per_node', ['NPROC_PER_NODE'])
  return found, source


FLAG_KEYS = ('nnodes', 'node_rank', 'nproc_per_node', 'master_addr', 'master_port', 'rdzv_id')


def resolve(given, env):
  """Settings from the flags given ({name: value or None}, as parsed) over the environment."""
  found, source = _from_env(env)
  found.update({k: (v, f'--{k}') for k, v in given.items() if v is not None and k in FLAG_KEYS})

  def value(key, default):
    return found.get(key, (default, None))

  def number(key, default, minimum):
    v, origin = value(key, default)
    if origin is None:
      return v
    fix = f'pass --{key} >= {minimum}' if origin.startswith('--') else f'fix {origin} or pass --{key}'
    return _int(v, origin, minimum, fix)

  nnodes = number('nnodes', 1, 1)
  node_rank = number('node_rank', 0, 0)
  nproc = number('nproc_per_node', 1, 1)
  port = number('master_port', DEFAULT_PORT, 1)
  if port > 65535:
    raise LaunchError(f'{found["master_port"][1]}={port} is not a TCP port (1..65535): pass --master_port')
  nodes = f'{nnodes} node(s) ({value("nnodes", 1)[1] or "default"})'
  if node_rank >= nnodes:
    raise LaunchError(f'{found["node_rank"][1]}={node_rank} is not below the node count, {nodes}: node ranks '
                      f'run 0..{nnodes - 1}; fix the variables or pass --nnodes and --node_rank')
  master = value('master_addr', None)[0]
  if nnodes > 1 and not master:
    unset = 'SLURM_JOB_NODELIST and MASTER_ADDR are' if source == 'SLURM' else 'MASTER_ADDR is'
    raise LaunchError(f'{unset} unset with {nodes}: export MASTER_ADDR=HOST (node 0\'s '
                      'host, on every node) or pass --master_addr=HOST')
  # srun starts one task per CPU or GPU unless told otherwise: each would be a whole launcher.
  tasks = env.get('SLURM_STEP_NUM_TASKS', str(nnodes)) if source == 'SLURM' else str(nnodes)
  if tasks != str(nnodes):
    raise LaunchError(f'SLURM_STEP_NUM_TASKS={tasks} launchers for {nodes}: start one per node '
                      '(srun --ntasks-per-node=1) and the ranks with --nproc_per_node')
  return Settings(nnodes, node_rank, nproc, master, port, str(value('rdzv_id', DEFAULT_RDZV_ID)[0]), source)


def torchrun_argv(settings, command, torchrun=('torchrun',)):
  """The torchrun command line for this node: `torchrun` is the program's argv prefix."""
  s = settings
  if s.nnodes == 1:
    return [*torchrun, '--standalone', f'--nproc_per_node={s.nproc_per_node}', *command]
  host = f'[{s.master_addr}]' if ':' in s.master_addr else s.master_addr   # IPv6 needs brackets
  return [*torchrun, f'--nnodes={s.nnodes}', f'--nproc_per_node={s.nproc_per_node}', '--rdzv_backend=c10d',
          f'--rdzv_endpoint={host}:{s.master_port}', f'--rdzv_id={s.rdzv_id}', *command]


def torchrun_program():
  """The torchrun of this Python, so the ranks run in the launcher's environment."""
  path = os.path.join(os.path.dirname(sys.executable), 'torchrun')
  return (path,) if os.access(path, os.X_OK) else (sys.executable, '-m', 'torch.distributed.run')


def define_flags():
  flags.DEFINE_integer('nproc_per_node', None, 'ranks on this node (default NPROC_PER_NODE, else 1)')
  flags.DEFINE_integer('nnodes', None, 'nodes in the job (default from SLURM, OpenMPI or NNODES)')
  flags.DEFINE_integer('node_rank', None, 'this node, 0-based (default from the scheduler or NODE_RANK)')
  flags.DEFINE_string('master_addr', None, 'rendezvous host (default from the node list or MASTER_ADDR)')
  flags.DEFINE_integer('master_port', None, f'rendezvous port (MASTER_PORT, else {DEFAULT_PORT})')
  flags.DEFINE_string('rdzv_id', None, f'rendezvous id (default SLURM_JOB_ID, else {DEFAULT_RDZV_ID})')
  flags.DEFINE_bool('dry_run', False, 'print the torchrun command and exit')


def parse_flags(argv):
  """absl's parsing of the launcher's own flags, those before `--`; what follows `--` is the
  training command, returned (to main) untouched."""
  split = argv.index('--') if '--' in argv else len(argv)
  try:
    extra = FLAGS(argv[:split], known_only=True)[1:]
  except flags.Error as e:
    tools.fail(f'{e}; python -m tools.launch --help lists the flags')
  if extra:
    tools.fail(f'unrecognized arguments {" ".join(extra)}: the training command goes after --, '
               'e.g. python -m tools.launch --nproc_per_node=2 -- train.py --config=...')
  command = argv[split + 1:]
  if not command:
    tools.fail('no training command: name it after --, e.g. python -m tools.launch -- train.py --config=...')
  return command


def describe(s):
  if s.nnodes == 1:
    return 'one node, standalone'
  return (f'node {s.node_rank} of {s.nnodes} ({s.source}), rendezvous {s.master_addr}:{s.master_port} '
          f'id {s.rdzv_id}')


def main(command):
  """Errors a user can fix end in one line, exit 2 (user_errors.py)."""
  user_errors.exit_on_error(_main, command)


def _main(command):
  settings = resolve({k: FLAGS[k].value for k in FLAG_KEYS}, os.environ)
  cmd = torchrun_argv(settings, command, torchrun_program())
  if FLAGS.dry_run:
    print(shlex.join(cmd))
    return
  print(f'launch: {describe(settings)}: {shlex.join(cmd)}', file=sys.stderr, flush=True)
  os.execv(cmd[0], cmd)


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=parse_flags)
