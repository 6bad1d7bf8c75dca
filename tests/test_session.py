"""Checkpoints in the training loop: bitwise resume, resume at another layout, preemption,
weights-only init from Hugging Face."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from checkpoint import manager as managers, store
from tests import parity, world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkpointed(layout, max_steps=20, exit_interval=0, dropout=0.0):
  c = parity.parity_config(**layout, dropout=dropout)
  c.trainer.max_steps, c.trainer.exit_interval = max_steps, exit_interval
  c.exp_manager.create_checkpoint_callback = True
  c.exp_manager.resume_if_exists = True
  return c


def _run(workdir, layout, exit_interval=0, dropout=0.0):
  """On every rank: train (or resume) to the end or to exit_interval; return rank 0's losses
  and this rank's parameter boxes (as parity.train_on_rank)."""
  import train  # pylint: disable=import-outside-toplevel
  config = checkpointed(layout, exit_interval=exit_interval, dropout=dropout)
  _, params = train.run(config, workdir)
  return parity.rank_result(config, workdir, params)


def losses(workdir):
  return [json.loads(line)['loss'] for line in open(os.path.join(workdir, 'metrics.jsonl'))
          if '"loss"' in line]


@pytest.mark.parametrize('world_size,layout,dropout', [
    (1, {}, 0.0),
    (2, {'zero1': True}, 0.1),            # dropout keys and ZeRO-1 shards survive the restart
])
def test_resume_is_bitwise_exact(tmp_path, world_size, layout, dropout):
  straight = world.run(_run, world_size, str(tmp_path / 'straight'), layout, 0, dropout)
  world.run(_run, world_size, str(tmp_path / 'resumed'), layout, 10, dropout)
  assert managers.CheckpointManager(str(tmp_path / 'resumed' / 'checkpoints')).committed_steps() == [10]
  resumed = world.run(_run, world_size, str(tmp_path / 'resumed'), layout, 0, dropout)
  assert losses(tmp_path / 'resumed') == losses(tmp_path / 'straight')      # identical floats
  a = parity.assemble(straight, parity.parity_config().model)
  b = parity.assemble(resumed, parity.parity_config().model)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


SAVED_AT = {'tp': 2, 'sp': True, 'pp': 2, 'zero1': True, 'layers': 4}


@pytest.fixture(scope='module')
def saved_at_tp2_pp2_dp2(tmp_path_factory):
  """Steps 1-10 at tp2 x pp2 x dp2 with ZeRO-1 (8 processes), and the uninterrupted reference."""
  base = tmp_path_factory.mktemp('reshard')
  world.run(_run, 8, str(base / 'saved'), SAVED_AT, 10)
  world.run(_run, 1, str(base / 'straight'), {'layers': 4})
  return base


@pytest.mark.parametrize('world_size,layout', [
    (1, {'layers': 4}),
    (4, {'pp': 4, 'layers': 4}),
    (4, {'tp': 4, 'kv_replicator': 2, 'layers': 4, 'zero1': True}),
])
def test_resume_at_another_layout_continues_the_run(saved_at_tp2_pp2_dp2, tmp_path, world_size, layout):
  base = saved_at_tp2_pp2_dp2
  workdir = tmp_path / 'run'
  os.makedirs(workdir)
  c = checkpointed(layout)
  c.exp_manager.resume_from_checkpoint = str(base / 'saved' / 'checkpoints' / 'step_00000010')
  # the optimizer moments saved at tp2 x pp2 x dp2 read back whole at any layout
  saved = str(base / 'saved' / 'checkpoints' / 'step_00000010')
  meta = managers.read_metadata(saved)
  assert meta['layout'] == {'dp': 2, 'pp': 2, 'tp': 2, 'vp': 1, 'zero1': True}
  world.run(_resume_from, world_size, str(workdir), layout, saved)
  np.testing.assert_allclose(losses(workdir), losses(base / 'straight')[10:], rtol=1e-5)


def _resume_from(workdir, layout, path):
  import train  # pylint: disable=import-outside-toplevel
  config = checkpointed(layout)
  config.exp_manager.resume_if_exists = False
  config.exp_manager.resume_from_checkpoint = path
  train.run(config, workdir)


def test_saved_moments_read_back_whole(saved_at_tp2_pp2_dp2):
  path = str(saved_at_tp2_pp2_dp2 / 'saved' / 'checkpoints' / 'step_00000010')
  name = 'optim.exp_avg_sq.layers.1.self_attn.q_proj.weight'
  whole = store.load_arrays(path, {name: (slice(0, 32), slice(0, 32))})[name]
  halves = [store.load_arrays(path, {name: (slice(a, a + 16), slice(0, 32))})[name] for a in (0, 16)]
  assert whole.shape == (32, 32) and (whole > 0).all()
  np.testing.assert_array_equal(whole.numpy(), np.concatenate([h.numpy() for h in halves]))


def test_sigterm_saves_commits_and_exits_zero(tmp_path):
  args = [sys.executable, 'train.py', '--config=configs/llama_tiny.py:test', f'--workdir={tmp_path}',
          '--config.trainer.max_steps=100000', '--config.exp_manager.create_checkpoint_callback=True',
          '--config.exp_manager.create_tensorboard_logger=False', '--config.trainer.val_check_interval=0']
  proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in proc.stdout:                     # wait until training runs, then preempt
    if 'step 3/' in line:
      proc.send_signal(signal.SIGTERM)
      break
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out
  steps = managers.CheckpointManager(str(tmp_path / 'checkpoints')).committed_steps()
  assert len(steps) == 1 and steps[0] >= 3
  assert 'SIGTERM' in out


def test_init_from_hugging_face_loads_the_weights(tmp_path):
  import torch  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  from model import hf, transformer  # pylint: disable=import-outside-toplevel
  c = parity.parity_config()
  c.trainer.max_steps = 1
  weights = transformer.init(c.model, 99)
  hf.save_hf(str(tmp_path / 'hf'), c.model, weights)
  c.exp_manager.init_from = str(tmp_path / 'hf')
  c.model.optim.lr = 1e-12                     # one step barely moves them
  c.trainer.gradient_clip_val = 0.0
  _, params = train.run(c, str(tmp_path / 'run'))
  for name, value in weights.items():
    torch.testing.assert_close(params[name].detach(), value.detach(), atol=1e-6, rtol=0)
  c.model.num_layers = 3
  with pytest.raises(ValueError, match='model.num_layers: config 3 vs checkpoint 2'):
    train.run(c, str(tmp_path / 'run2'))
