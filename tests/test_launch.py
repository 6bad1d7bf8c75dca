"""tools/launch.py: SLURM, OpenMPI and plain variables (and flags over them) to a torchrun
command, Slurm node lists, one-line errors; end to end, two launchers as two SLURM nodes on
this machine log the same losses as one node with the same two ranks."""
import contextlib
import os
import subprocess
import sys

import pytest

from tests import procs, world
from tests.test_train import read_metrics
from tools import launch

NO_FLAGS = dict.fromkeys(launch.FLAG_KEYS)
SLURM = {'SLURM_JOB_ID': '4242', 'SLURM_JOB_NUM_NODES': '4', 'SLURM_NNODES': '4', 'SLURM_NODEID': '2',
         'SLURM_JOB_NODELIST': 'node[001-004]', 'SLURM_NODELIST': 'node[001-004]'}
OMPI = {'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '1',
        'MASTER_ADDR': 'worker-0.job'}


def settings(env, **flags):
  return launch.resolve(dict(NO_FLAGS, **flags), env)


def error(env, **flags):
  with pytest.raises(launch.LaunchError) as e:
    settings(env, **flags)
  return str(e.value)


@pytest.mark.parametrize('nodelist, hosts', [
    ('node[001-004,007]', ['node001', 'node002', 'node003', 'node004', 'node007']),
    ('gpu-a[1-2],gpu-b3', ['gpu-a1', 'gpu-a2', 'gpu-b3']),
    ('host1', ['host1']),
    ('n[8-10]', ['n8', 'n9', 'n10']),                                # no padding: widths grow
    ('10.0.0.[1-2]', ['10.0.0.1', '10.0.0.2']),
    ('rack[1-2]-n[01,03]', ['rack1-n01', 'rack1-n03', 'rack2-n01', 'rack2-n03']),
])
def test_node_lists_expand_as_slurm_does(nodelist, hosts):
  assert launch.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize('nodelist', ['node[001-', 'node]1[', 'node[4-1]', 'node[a-b]', 'node[]', 'a,,b', '',
                                      'node[1-[2]]'])
def test_unreadable_node_lists_are_refused(nodelist):
  with pytest.raises(ValueError):
    launch.expand_nodelist(nodelist)


def test_slurm_gives_the_nodes_the_rank_the_first_host_and_the_job_id():
  s = settings(SLURM, nproc_per_node=32)
  assert s == launch.Settings(4, 2, 32, 'node001', 29500, '4242', 'SLURM')
  assert launch.torchrun_argv(s, ['train.py', '--config=c.py']) == [
      'torchrun', '--nnodes=4', '--nproc_per_node=32', '--rdzv_backend=c10d',
      '--rdzv_endpoint=node001:29500', '--rdzv_id=4242', 'train.py', '--config=c.py']


def test_slurm_prefers_the_steps_variables_and_its_node_list_to_a_stale_master_addr():
  env = dict(SLURM, SLURM_STEP_NUM_NODES='2', SLURM_STEP_NODELIST='node[003-004]', SLURM_NODEID='1',
             SLURM_STEP_NUM_TASKS='2', MASTER_ADDR='localhost', MASTER_PORT='6000')
  assert settings(env) == launch.Settings(2, 1, 1, 'node003', 6000, '4242', 'SLURM')
  bare = {k: v for k, v in env.items() if 'NODELIST' not in k}          # no list: MASTER_ADDR serves
  assert settings(bare).master_addr == 'localhost'


def test_openmpi_gives_the_launchers_world_and_master_addr():
  s = settings(OMPI, nproc_per_node=8)
  assert s == launch.Settings(2, 1, 8, 'worker-0.job', 29500, 'flatron', 'OpenMPI')
  inside_slurm = dict(SLURM, **OMPI)            # mpirun in an allocation: OMPI_* describe the launchers
  assert settings(inside_slurm) == launch.Settings(2, 1, 1, 'worker-0.job', 29500, 'flatron', 'OpenMPI')


def test_plain_variables_and_no_variables():
  env = {'NNODES': '3', 'NODE_RANK': '0', 'MASTER_ADDR': '10.1.2.3', 'MASTER_PORT': '7000',
         'NPROC_PER_NODE': '4'}
  assert settings(env) == launch.Settings(3, 0, 4, '10.1.2.3', 7000, 'flatron', 'env')
  assert launch.torchrun_argv(settings({}), ['train.py']) == [
      'torchrun', '--standalone', '--nproc_per_node=1', 'train.py']
  one = launch.torchrun_argv(settings(dict(SLURM, SLURM_JOB_NUM_NODES='1', SLURM_NODEID='0')), ['t.py'])
  assert one[1:] == ['--standalone', '--nproc_per_node=1', 't.py']   # one node needs no host or port


def test_flags_override_every_source():
  flags = dict(nnodes=2, node_rank=0, master_addr='::1', master_port=1234, rdzv_id='mine', nproc_per_node=2)
  for env in (SLURM, OMPI, {'NNODES': '9', 'NODE_RANK': '8', 'MASTER_ADDR': 'x', 'NPROC_PER_NODE': '7'}):
    s = settings(env, **flags)
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port, s.rdzv_id, s.nproc_per_node) == (
        2, 0, '::1', 1234, 'mine', 2)
  assert '--rdzv_endpoint=[::1]:1234' in launch.torchrun_argv(s, ['t.py'])   # IPv6 in brackets


def test_inconsistent_settings_name_the_variable_and_the_fix():
  msg = error(dict(SLURM, SLURM_NODEID='4'))
  assert 'SLURM_NODEID=4 is not below the node count, 4 node(s) (SLURM_JOB_NUM_NODES)' in msg
  assert '--node_rank' in msg
  msg = error({'NNODES': '2', 'NODE_RANK': '2', 'MASTER_ADDR': 'h'})
  assert 'NODE_RANK=2 is not below the node count, 2 node(s) (NNODES)' in msg
  assert '--node_rank=1 is not below the node count, 1 node(s) (default)' in error({}, node_rank=1)
  msg = error(dict(SLURM, SLURM_JOB_NODELIST='node[1-'))
  assert "SLURM_JOB_NODELIST='node[1-' is not a Slurm node list" in msg and '--master_addr=HOST' in msg
  msg = error({k: v for k, v in OMPI.items() if k != 'MASTER_ADDR'})
  assert 'MASTER_ADDR is unset with 2 node(s) (OMPI_COMM_WORLD_SIZE)' in msg and '--master_addr' in msg
  assert 'MASTER_ADDR is unset with 2 node(s) (--nnodes)' in error({}, nnodes=2, node_rank=1)
  msg = error({k: v for k, v in SLURM.items() if 'NODELIST' not in k})
  assert 'SLURM_JOB_NODELIST and MASTER_ADDR are unset' in msg
  assert 'OMPI_COMM_WORLD_LOCAL_SIZE=4' in error(dict(OMPI, OMPI_COMM_WORLD_LOCAL_SIZE='4'))
  msg = error(dict(SLURM, SLURM_STEP_NUM_TASKS='128'))
  assert 'SLURM_STEP_NUM_TASKS=128 launchers for 4 node(s) (SLURM_JOB_NUM_NODES)' in msg
  assert 'srun --ntasks-per-node=1' in msg
  assert "NNODES='two' is not an integer >= 1: fix NNODES or pass --nnodes" in error({'NNODES': 'two'})
  assert 'MASTER_PORT=70000 is not a TCP port' in error({'MASTER_PORT': '70000'})
  assert '--nproc_per_node=0 is not an integer >= 1' in error({}, nproc_per_node=0)


# Variables a test process may have inherited (a CI job under SLURM) that would steer the launcher.
STEERING = ('SLURM_', 'OMPI_', 'MASTER_ADDR', 'MASTER_PORT', 'NNODES', 'NODE_RANK', 'NPROC_PER_NODE')
COMMON = ['--config=configs/llama_tiny.py:test', '--config.trainer.max_steps=3',
          '--config.model.optim.sched.warmup_steps=2', '--config.exp_manager.create_tensorboard_logger=False',
          '--config.trainer.val_check_interval=0']


def launcher_env(**variables):
  env = {k: v for k, v in os.environ.items() if not k.startswith(STEERING)}
  return dict(env, OMP_NUM_THREADS='1', **variables)


def launch_cli(*argv, **variables):
  """`python -m tools.launch ARGV` under exactly these scheduler variables."""
  return procs.run([sys.executable, '-m', 'tools.launch', *argv], timeout=60, env=launcher_env(**variables))


def test_the_cli_prints_the_command_or_one_error_line():
  out = launch_cli('--dry_run', '--nproc_per_node=32', '--', 'train.py', '--config=c.py', '--', '--help', **SLURM)
  assert out.returncode == 0, out.stderr
  assert out.stdout.endswith(' --nnodes=4 --nproc_per_node=32 --rdzv_backend=c10d --rdzv_endpoint=node001:29500 '
                             '--rdzv_id=4242 train.py --config=c.py -- --help\n')   # after --: untouched
  out = launch_cli('--dry_run', '--', 'train.py', **dict(SLURM, SLURM_NODEID='9'))
  assert out.returncode == 2 and out.stderr.count('\n') == 1 and 'SLURM_NODEID=9' in out.stderr
  for argv, says in ((['train.py'], 'the training command goes after --'), (['--'], 'no training command'),
                     (['--nproc_per_node=two', '--', 't.py'], "flag --nproc_per_node=two: invalid literal")):
    out = launch_cli(*argv)
    assert out.returncode == 2 and out.stderr.count('\n') == 1 and says in out.stderr, out.stderr


def test_two_launchers_as_two_slurm_nodes_log_the_single_node_losses(tmp_path):
  single = procs.run([sys.executable, '-m', 'tools.launch', '--nproc_per_node=2', '--', 'train.py', *COMMON,
                      f'--workdir={tmp_path / "single"}'], timeout=300, env=launcher_env())
  assert single.returncode == 0, single.stderr[-3000:]
  torchrun = launch.torchrun_program()[0]
  assert f'launch: one node, standalone: {torchrun} --standalone --nproc_per_node=2 train.py' in single.stderr

  port = world.free_port()
  slurm = dict(SLURM_JOB_ID='4242', SLURM_JOB_NUM_NODES='2', SLURM_JOB_NODELIST='127.0.0.1',
               SLURM_STEP_NUM_TASKS='2', MASTER_PORT=str(port))
  cmd = [sys.executable, '-m', 'tools.launch', '--', 'train.py', *COMMON, f'--workdir={tmp_path / "multi"}']
  logs = [tmp_path / f'node{rank}.log' for rank in (0, 1)]
  # Both launchers run at once, as on two nodes; output goes to files, so neither blocks on a
  # full pipe while the other is waited for.
  with contextlib.ExitStack() as stack:
    nodes = []
    for rank, log in enumerate(logs):
      out = stack.enter_context(open(log, 'w'))
      nodes.append(stack.enter_context(procs.started(
          cmd, env=launcher_env(**slurm, SLURM_NODEID=str(rank)), stdout=out, stderr=subprocess.STDOUT)))
    codes = [node.wait(timeout=300) for node in nodes]
  texts = [log.read_text() for log in logs]
  assert codes == [0, 0], '\n'.join(t[-3000:] for t in texts)
  for rank, text in enumerate(texts):
    assert f'launch: node {rank} of 2 (SLURM), rendezvous 127.0.0.1:{port} id 4242:' in text
    assert f'--nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:{port}' in text
  assert 'dp=2 x pp=1 x tp=1' in ''.join(texts)
  losses = lambda d: [r['loss'] for r in read_metrics(d) if 'loss' in r]
  assert len(losses(tmp_path / 'single')) == 3
  assert losses(tmp_path / 'multi') == losses(tmp_path / 'single')
