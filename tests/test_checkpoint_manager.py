"""checkpoint/manager.py: commit protocol under SIGKILL, keep-last-K, stale cleanup, async overlap
and ordering, resume semantics (NxDT exp_manager), corruption fallback agreed by all ranks, S3 through
moto; steps named by a filename template, kept by a monitored metric, pinned by save_last and by a stop."""
import datetime
import json
import logging
import multiprocessing
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from checkpoint import manager, steps as checkpoint_steps, store
from tests import world
from tests.test_checkpoint_store import flip_byte_of

FULL = (slice(None), slice(None))


def weights(step):
  return torch.randn(64, 32, generator=torch.Generator().manual_seed(step))


LAYOUT = {'w': store.ArrayLayout.from_boxes((64, 32), 'float32', [FULL])}


def save(m, step, pin=False, **metadata):
  m.save(step, {'w': weights(step)}, LAYOUT, {'consumed_samples': 8 * step, **metadata}, pin=pin)


def loads_as_saved(m, step):
  arrays, metadata = m.load(step, {'w': FULL})
  return torch.equal(arrays['w'], weights(step)) and metadata['consumed_samples'] == 8 * step


def dirs(root):
  return sorted(os.listdir(root))


# ---- crash safety ----

def _save_until_killed(root, phase, phase_step, reached):
  """Commit steps 1, 2, then save step 3 and stop forever at (phase, phase_step)."""
  m = manager.CheckpointManager(root, save_top_k=2)
  save(m, 1)
  save(m, 2)

  def hook(name, step):
    if (name, step) == (phase, phase_step):
      reached.set()
      threading.Event().wait()  # never set: the parent kills this process here

  save(manager.CheckpointManager(root, save_top_k=2, hook=hook), 3)


# phase -> committed steps after a SIGKILL there
KILL_POINTS = {('written', 3): [1, 2], ('merged', 3): [1, 2], ('metadata', 3): [1, 2],
               ('committed', 3): [1, 2, 3], ('unmarked', 1): [2, 3]}


def test_sigkill_anywhere_in_a_save_leaves_the_last_commit_loadable(tmp_path):
  ctx = multiprocessing.get_context('spawn')
  runs = []
  try:
    for i, (phase, step) in enumerate(KILL_POINTS):  # all at once: the spawns overlap
      reached = ctx.Event()
      proc = ctx.Process(target=_save_until_killed, args=(str(tmp_path / str(i)), phase, step, reached),
                         daemon=True)
      proc.start()
      runs.append((proc, reached))
    for proc, reached in runs:
      assert reached.wait(timeout=120), 'the saving process never reached its kill point'
      os.kill(proc.pid, signal.SIGKILL)
      proc.join()
  finally:
    for proc, _ in runs:
      if proc.is_alive():
        proc.kill()
  for i, expected in enumerate(KILL_POINTS.values()):
    m = manager.CheckpointManager(str(tmp_path / str(i)), save_top_k=2)
    assert m.committed_steps() == expected
    assert m.latest_committed() == expected[-1] and loads_as_saved(m, expected[-1])
    assert len(dirs(m.root)) == 3           # the killed save's (or pruned step's) leftovers
    save(m, 4)                              # cleans them and prunes to the newest two
    assert dirs(m.root) == [checkpoint_steps.step_dir(s) for s in expected[-1:] + [4]]


# ---- keep-last-K, uncommitted steps, metadata ----

def test_keep_last_k_deletes_older_steps_never_the_newest(tmp_path):
  for keep, expected in ((2, [3, 4]), (1, [4]), (0, [1, 2, 3, 4])):
    m = manager.CheckpointManager(str(tmp_path / str(keep)), save_top_k=keep)
    for step in (1, 2, 3, 4):
      save(m, step)
    assert m.committed_steps() == expected
    assert dirs(m.root) == [checkpoint_steps.step_dir(s) for s in expected]
    assert all(loads_as_saved(m, s) for s in expected)


def test_a_step_without_marker_is_ignored_then_cleaned(tmp_path):
  m = manager.CheckpointManager(str(tmp_path), save_top_k=5)
  save(m, 1)
  save(m, 2)
  os.remove(os.path.join(m.step_path(2), checkpoint_steps.MARKER))
  assert m.committed_steps() == [1] and m.latest_committed() == 1
  with pytest.raises(store.CheckpointError, match='not a committed checkpoint'):
    m.load(2, {'w': FULL})
  save(m, 3)
  assert dirs(m.root) == [checkpoint_steps.step_dir(1), checkpoint_steps.step_dir(3)]


def test_metadata_records_step_caller_metadata_and_array_shapes(tmp_path):
  m = manager.CheckpointManager(str(tmp_path))
  save(m, 7, config={'model': {'hidden_size': 32}}, layout={'dp': 1, 'pp': 1, 'tp': 1})   # consumed_samples 56
  meta = json.load(open(os.path.join(m.step_path(7), 'metadata.json')))
  assert meta == {'format_version': manager.FORMAT_VERSION, 'step': 7, 'consumed_samples': 56,
                  'config': {'model': {'hidden_size': 32}}, 'layout': {'dp': 1, 'pp': 1, 'tp': 1},
                  'arrays': {'w': {'shape': [64, 32], 'dtype': 'float32', 'chunk_shape': [64, 32]}}}


def test_saving_an_already_committed_step_again_is_skipped(tmp_path, caplog):
  m = manager.CheckpointManager(str(tmp_path))
  save(m, 1)
  with caplog.at_level(logging.WARNING):
    m.save(1, {'w': torch.zeros(64, 32)}, LAYOUT)
  assert 'already committed' in caplog.text and loads_as_saved(m, 1)


# ---- filename template, monitor / mode, save_last, pin ----

TEMPLATE = 'megatron_llama--{step}-{consumed_samples}'


def test_a_filename_template_names_finds_cleans_prunes_and_resumes_steps(tmp_path):
  m = manager.CheckpointManager(str(tmp_path / 'run'), save_top_k=2, filename=TEMPLATE)
  for step in (1, 2, 3):
    save(m, step)
  assert dirs(m.root) == ['megatron_llama--2-16', 'megatron_llama--3-24']
  assert m.committed_steps() == [2, 3] and loads_as_saved(m, 3)
  os.remove(os.path.join(m.step_path(3), checkpoint_steps.MARKER))        # a save of step 3 that crashed...
  assert resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)[0] == 2
  save(m, 4)                                                     # ...is cleaned by the next one
  assert dirs(m.root) == ['megatron_llama--2-16', 'megatron_llama--4-32']
  # another run (its own naming) resuming from this root finds the steps by their markers
  other = manager.CheckpointManager(str(tmp_path / 'other'))
  assert other.resolve_resume(False, False, m.root) == os.path.join(m.root, 'megatron_llama--4-32')
  assert checkpoint_steps.committed_dirs(m.root) == {2: 'megatron_llama--2-16', 4: 'megatron_llama--4-32'}
  # a run that changes its naming still finds, resumes from and prunes its earlier steps
  mixed = str(tmp_path / 'mixed')
  save(manager.CheckpointManager(mixed), 1)
  m = manager.CheckpointManager(mixed, save_top_k=2, filename=TEMPLATE)
  assert resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)[0] == 1
  save(m, 2)
  save(m, 3)
  assert dirs(mixed) == ['megatron_llama--2-16', 'megatron_llama--3-24']


VAL_LOSSES = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5}


@pytest.mark.parametrize('save_last,expected', [(True, [2, 4]), (False, [2])])
def test_top_k_by_val_loss_keeps_the_best_and_with_save_last_the_newest(tmp_path, save_last, expected):
  m = manager.CheckpointManager(str(tmp_path), save_top_k=1, monitor='val_loss', mode='min', save_last=save_last)
  for step, loss in VAL_LOSSES.items():
    save(m, step, metrics={'val_loss': loss})
  assert m.committed_steps() == expected
  assert checkpoint_steps.read_metadata(m.step_path(2))['metrics'] == {'val_loss': 1.0}
  assert resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)[0] == expected[-1]   # the newest


def test_mode_max_keeps_the_highest_a_stop_is_pinned_and_a_step_without_the_metric_ranks_last(tmp_path):
  m = manager.CheckpointManager(str(tmp_path), save_top_k=2, monitor='val_loss', mode='max', save_last=False)
  for step, loss in VAL_LOSSES.items():
    save(m, step, metrics={'val_loss': loss})
  assert m.committed_steps() == [1, 4]
  save(m, 5, pin=True, metrics={'val_loss': 0.5})   # a stop's save: kept although it ranks last
  assert m.committed_steps() == [1, 4, 5]
  save(m, 6)                                # no metrics: ranks below every scored step
  assert m.committed_steps() == [1, 4]


# ---- async ----

def test_async_save_returns_after_the_host_copy_and_writes_while_the_caller_works(tmp_path):
  main_worked, order = threading.Event(), []

  def hook(phase, step):
    order.append(phase)
    if phase == 'cleaned':  # the writer cannot go on until the main thread has done its work
      assert main_worked.wait(timeout=60), 'save() did not return before writing'

  m = manager.CheckpointManager(str(tmp_path), async_save=True, hook=hook)
  w = weights(1)
  m.save(1, {'w': w}, LAYOUT, {'consumed_samples': 8})
  w.zero_()                 # the caller owns its tensors again once save() returned
  order.append('main work')
  main_worked.set()
  m.wait()
  assert order.index('main work') < order.index('written') < order.index('committed')
  assert loads_as_saved(m, 1)


def test_a_second_save_waits_for_the_first(tmp_path):
  release, order = threading.Event(), []

  def hook(phase, step):
    order.append((phase, step))
    if phase == 'waiting':
      release.set()
    if (phase, step) == ('cleaned', 1):
      assert release.wait(timeout=60)

  m = manager.CheckpointManager(str(tmp_path), async_save=True, hook=hook)
  save(m, 1)
  save(m, 2)                # blocks (hook 'waiting') until step 1 is done
  m.wait()
  assert (order.index(('waiting', 1)) < order.index(('written', 1)) < order.index(('pruned', 1))
          < order.index(('cleaned', 2)))
  assert m.committed_steps() == [1, 2]


def test_an_error_in_the_writer_thread_is_raised_by_the_next_wait(tmp_path):
  def hook(phase, step):
    if (phase, step) == ('written', 1):
      raise OSError('disk full')

  m = manager.CheckpointManager(str(tmp_path), async_save=True, hook=hook)
  save(m, 1)
  with pytest.raises(OSError, match='disk full'):
    m.wait()
  m.wait()                  # raised once
  assert m.latest_committed() is None
  save(m, 2)
  m.wait()
  assert dirs(m.root) == [checkpoint_steps.step_dir(2)]


# ---- resume ----

def resume(m, **kwargs):
  return m.resume({'w': FULL}, **kwargs)


def test_resume_follows_nxdt_exp_manager_semantics(tmp_path, caplog):
  m = manager.CheckpointManager(str(tmp_path / 'run'))
  with caplog.at_level(logging.WARNING):
    assert resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=True) is None
  assert 'starting fresh' in caplog.text
  with pytest.raises(FileNotFoundError, match='resume_ignore_no_checkpoint'):
    resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)
  save(m, 1)
  save(m, 2)
  assert resume(m, resume_if_exists=False, resume_ignore_no_checkpoint=False) is None
  step, arrays, meta = resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)
  assert step == 2 and torch.equal(arrays['w'], weights(2)) and meta['consumed_samples'] == 16
  # An explicit checkpoint wins: a step directory, or another run's root (its newest step).
  other = manager.CheckpointManager(str(tmp_path / 'other'))
  save(other, 5)
  assert m.resolve_resume(True, False, m.step_path(1)) == m.step_path(1)
  assert m.resolve_resume(False, False, other.root) == other.step_path(5)
  for explicit, expected in ((m.step_path(1), 1), (other.root, 5)):
    assert resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False,
                  resume_from_checkpoint=explicit)[0] == expected
  with pytest.raises(FileNotFoundError, match='neither a committed checkpoint'):
    resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=True,
           resume_from_checkpoint=str(tmp_path / 'nothing'))


def test_a_corrupt_newest_step_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
  m = manager.CheckpointManager(str(tmp_path), save_top_k=3)
  for step in (1, 2):
    save(m, step)
  flip_byte_of(m.step_path(2), weights(2)[5].numpy().tobytes())
  with caplog.at_level(logging.WARNING):
    step, arrays, _ = resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)
  assert step == 1 and torch.equal(arrays['w'], weights(1))
  assert 'step_00000002' in caplog.text and 'checksum' in caplog.text
  # the rejected step is moved aside (kept for inspection), so the resumed run writes it afresh
  assert f'moved it aside to {m.step_path(2)}.rejected' in caplog.text
  assert m.committed_steps() == [1] and os.path.isdir(m.step_path(2) + '.rejected')
  assert checkpoint_steps.committed_dirs(m.root) == {1: checkpoint_steps.step_dir(1)}     # moved aside, marker and all
  save(m, 2)
  assert m.committed_steps() == [1, 2] and loads_as_saved(m, 2)
  flip_byte_of(m.step_path(2), weights(2)[5].numpy().tobytes())
  flip_byte_of(m.step_path(1), weights(1)[5].numpy().tobytes())
  with pytest.raises(store.CheckpointError, match='no checkpoint could be loaded'):
    resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)


# ---- two ranks: async writes beside training collectives; fallback agreed by all ----

def _two_ranks(root):
  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))
  rank, group = dist.get_rank(), dist.new_group(backend='gloo')
  rows = [(slice(0, 32), slice(None)), (slice(32, 64), slice(None))]
  layout = {'w': store.ArrayLayout.from_boxes((64, 32), 'float32', rows),
            'norm': store.ArrayLayout.from_boxes((32,), 'bfloat16', [(slice(None),)] * 2)}
  m = manager.CheckpointManager(root, rank=rank, world_size=2, group=group, async_save=True)
  for step in (1, 2):
    m.save(step, {'w': weights(step)[rows[rank]], 'norm': torch.full((32,), step, dtype=torch.bfloat16)},
           layout, {'consumed_samples': 8 * step})
    dist.all_reduce(torch.ones(1))    # a training collective while the writer thread works
  m.wait()
  dist.barrier()
  if rank == 0:   # corrupt rows only rank 1 reads below: both ranks must still fall back
    flip_byte_of(m.step_path(2), weights(2)[3].numpy().tobytes())
  dist.barrier()
  step, arrays, meta = m.resume({'w': rows[1 - rank], 'norm': (slice(None),)}, resume_if_exists=True,
                                resume_ignore_no_checkpoint=False)
  return (step, meta['consumed_samples'], torch.equal(arrays['w'], weights(step)[rows[1 - rank]]),
          torch.equal(arrays['norm'], torch.full((32,), step, dtype=torch.bfloat16)),
          m.committed_steps())


def test_two_ranks_save_async_and_agree_on_the_fallback(tmp_path):
  assert world.run(_two_ranks, 2, str(tmp_path)) == [(1, 8, True, True, [1])] * 2


# ---- S3 (moto server on loopback) ----

def test_s3_root_saves_prunes_and_resumes(monkeypatch):
  moto_server = pytest.importorskip('moto.server')
  boto3 = pytest.importorskip('boto3')
  server = moto_server.ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)
  server.start()
  try:
    host, port = server.get_host_and_port()
    monkeypatch.setenv('AWS_ENDPOINT_URL', f'http://{host}:{port}')
    for key in ('AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY'):
      monkeypatch.setenv(key, 'testing')
    monkeypatch.setenv('AWS_DEFAULT_REGION', 'us-east-1')
    s3 = boto3.client('s3')
    s3.create_bucket(Bucket='ckpt')
    m = manager.CheckpointManager('s3://ckpt/runs/a', save_top_k=1)
    for step in (1, 2):
      save(m, step)
    s3.put_object(Bucket='ckpt', Key='runs/a/step_00000003/arrays/junk', Body=b'x')  # a crashed save
    assert m.committed_steps() == [2]
    step, arrays, _ = resume(m, resume_if_exists=True, resume_ignore_no_checkpoint=False)
    assert step == 2 and torch.equal(arrays['w'], weights(2))
    save(m, 4)
    keys = [o['Key'] for o in s3.list_objects_v2(Bucket='ckpt')['Contents']]
    assert {k.split('/')[2] for k in keys} == {'step_00000004'}
    assert 'runs/a/step_00000004/COMMITTED' in keys
  finally:
    server.stop()


NO_SPACE = 'this step is not committed and the last committed step is kept'   # docs/failure-and-recovery.md quotes it


@pytest.mark.parametrize('where', ['write_local', 'write_text'])
@pytest.mark.parametrize('code, said', [(28, 'no space left on'), (30, 'a read-only file system at'),
                                        (13, 'permission denied writing')])
def test_a_full_read_only_or_forbidden_disk_is_said_as_such_and_keeps_the_last_commit(tmp_path, monkeypatch, where,
                                                                                       code, said):
  from checkpoint import storage  # pylint: disable=import-outside-toplevel
  m = manager.CheckpointManager(str(tmp_path))
  save(m, 1)
  module = store if where == 'write_local' else storage

  def fault(*args, **kwargs):
    raise OSError(code, os.strerror(code))

  monkeypatch.setattr(module, where, fault)
  with pytest.raises(store.CheckpointError, match=f'{said} .*step_00000002: ' + NO_SPACE):
    save(m, 2)
  monkeypatch.undo()
  assert m.committed_steps() == [1] and loads_as_saved(m, 1)
