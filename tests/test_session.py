"""Checkpoints in the training loop: bitwise resume, resume at another layout, preemption,
weights-only init from Hugging Face, steps kept by a validation metric under a filename
template."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from checkpoint import manager as managers, preemption, steps as checkpoint_steps, store
from tests import parity, procs, world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkpointed(layout, max_steps=20, exit_interval=0, dropout=0.0):
  c = parity.parity_config(**layout, dropout=dropout)
  c.trainer.max_steps, c.trainer.exit_interval = max_steps, exit_interval
  c.exp_manager.create_checkpoint_callback = True
  c.exp_manager.resume_if_exists = True
  c.exp_manager.resume_ignore_no_checkpoint = True    # the first run starts fresh
  return c


def _run(workdir, layout, exit_interval=0, dropout=0.0):
  """On every rank: train (or resume) to the end or to exit_interval; return rank 0's losses
  and this rank's parameter boxes (as parity.train_on_rank). layout['fused_fp32_from']: the
  size from which fp32 rows take the one-pass Adam step (precision.FUSED_FP32_MIN_NUMEL)."""
  import train  # pylint: disable=import-outside-toplevel
  from numerics import precision  # pylint: disable=import-outside-toplevel
  layout = dict(layout)
  precision.FUSED_FP32_MIN_NUMEL = layout.pop('fused_fp32_from', precision.FUSED_FP32_MIN_NUMEL)
  config = checkpointed(layout, exit_interval=exit_interval, dropout=dropout)
  _, params = train.run(config, workdir)
  return parity.rank_result(config, workdir, params)


def losses(workdir):
  return [json.loads(line)['loss'] for line in open(os.path.join(workdir, 'metrics.jsonl'))
          if '"loss"' in line]


@pytest.mark.parametrize('world_size,layout,dropout', [
    (1, {}, 0.0),
    (2, {'zero1': True}, 0.1),            # dropout keys and ZeRO-1 shards survive the restart
    (2, {'zero1': True, 'precision': 'bf16SR'}, 0.0),   # bf16 moments, stochastic rounding keys
    # fp32 masters through the one-pass Adam step (the tiny model's parameters would take torch's)
    (2, {'zero1': True, 'precision': 'mixed_precision', 'fused_fp32_from': 0}, 0.0),
    (2, {'zero1': True, 'zero_stage': 3}, 0.1),        # ZeRO-3: each rank saves and loads its owned rows
])
def test_resume_is_bitwise_exact(tmp_path, world_size, layout, dropout):
  # the uninterrupted run, then steps 1-10 saved, in one world; the resume in a fresh one
  first = world.run(world.in_turn, world_size, [(_run, (str(tmp_path / 'straight'), layout, 0, dropout)),
                                                (_run, (str(tmp_path / 'resumed'), layout, 10, dropout))])
  straight = [rank[0] for rank in first]
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
  _run(str(base / 'straight'), {'layers': 4})         # the reference, in this process (as parity.reference)
  return base


RESUMED_AT = {                     # name: (world size, layout)
    'one_device': (1, {'layers': 4}),
    'pp4': (4, {'pp': 4, 'layers': 4}),
    'tp4_kv2_zero1': (4, {'tp': 4, 'kv_replicator': 2, 'layers': 4, 'zero1': True}),
    'dp2_tp2_zero2': (4, {'tp': 2, 'sp': True, 'layers': 4, 'zero1': True, 'zero_stage': 2}),   # ZeRO-1's save
    'dp2_tp2_zero3': (4, {'tp': 2, 'sp': True, 'layers': 4, 'zero1': True, 'zero_stage': 3}),
    'dp4_hsdp2_zero3': (4, {'layers': 4, 'zero1': True, 'zero_stage': 3, 'shard': 2}),
}


@pytest.mark.parametrize('world_size', parity.world_sizes(RESUMED_AT))
def test_resume_at_another_layout_continues_the_run(saved_at_tp2_pp2_dp2, tmp_path, world_size):
  """The optimizer moments saved at tp2 x pp2 x dp2 read back whole at any layout (the layouts
  of one world size resume one after another in one world)."""
  base = saved_at_tp2_pp2_dp2
  saved = str(base / 'saved' / 'checkpoints' / 'step_00000010')
  meta = checkpoint_steps.read_metadata(saved)
  assert meta['layout'] == {'dp': 2, 'pp': 2, 'tp': 2, 'cp': 1, 'vp': 1, 'zero1': True}
  layouts = parity.of_size(RESUMED_AT, world_size)
  for name in layouts:
    os.makedirs(tmp_path / name)
  world.run(world.in_turn, world_size, [(_resume_from, (str(tmp_path / name), layout, saved))
                                        for name, (_, layout) in layouts.items()])
  for name in layouts:
    np.testing.assert_allclose(losses(tmp_path / name), losses(base / 'straight')[10:], rtol=1e-5, err_msg=name)


def test_a_zero3_step_resumes_at_zero1_and_on_one_device(tmp_path):
  """Steps 1-10 saved at dp2 ZeRO-3 (owned rows only), resumed at dp2 ZeRO-1 and on one device:
  both continue the uninterrupted run."""
  world.run(_run, 2, str(tmp_path / 'saved'), {'zero1': True, 'zero_stage': 3, 'layers': 4}, 10)
  _run(str(tmp_path / 'straight'), {'layers': 4})
  saved = str(tmp_path / 'saved' / 'checkpoints' / 'step_00000010')
  assert checkpoint_steps.read_metadata(saved)['layout']['zero_stage'] == 3
  world.run(_resume_from, 2, str(tmp_path / 'zero1'), {'zero1': True, 'layers': 4}, saved)
  _resume_from(str(tmp_path / 'one_device'), {'layers': 4}, saved)
  for name in ('zero1', 'one_device'):
    np.testing.assert_allclose(losses(tmp_path / name), losses(tmp_path / 'straight')[10:], rtol=1e-5, err_msg=name)


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


def _train_cli(workdir, *extra):
  return [sys.executable, 'train.py', '--config=configs/llama_tiny.py:test', f'--workdir={workdir}',
          '--config.trainer.max_steps=100000', '--config.exp_manager.create_tensorboard_logger=False',
          '--config.trainer.val_check_interval=0', *extra]


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_saves_commits_and_exits_zero(tmp_path, signum):
  """Also with periodic checkpoints off: the stop always saves (to the default directory)."""
  with procs.started(_train_cli(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True) as proc:
    for line in proc.stdout:                   # wait until training runs, then stop it
      if 'step 3/' in line:
        proc.send_signal(signum)
        break
    out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out
  steps = managers.CheckpointManager(str(tmp_path / 'checkpoints')).committed_steps()
  assert len(steps) == 1 and steps[0] >= 3
  name = signal.Signals(signum).name
  assert f'stopped at step {steps[0]} by {name}; resume with --config.exp_manager.resume_if_exists=True' in out
  assert 'done:' not in out and 'Traceback' not in out


def _signal_in_every_window(check, module_file):
  """For each line that `check()` executes in `module_file`, a run in which the signal handler
  fires just before that line (Python runs handlers between bytecodes, so a real signal can
  land there). -> [(line, stopped by the first check, stopped by the second)]."""
  results, line_no = [], 0
  while True:
    signals = preemption.StopSignals(install=False)
    seen = []

    def tracer(frame, event, arg):  # pylint: disable=unused-argument
      if frame.f_code.co_filename != module_file:
        return None
      if event == 'line':
        seen.append(frame.f_lineno)
        if len(seen) == line_no + 1:
          signals.handle(signal.SIGTERM, frame)
      return tracer

    sys.settrace(tracer)
    try:
      first = check(signals)
    finally:
      sys.settrace(None)
    if line_no >= len(seen):
      return results
    results.append((seen[line_no], first, check(signals)))
    line_no += 1


def test_a_signal_between_reading_and_agreeing_is_never_lost():
  results = _signal_in_every_window(lambda signals: signals.agree(None), preemption.__file__)
  assert len(results) >= 3
  lost = [line for line, first, second in results if not (first or second)]
  assert not lost, f'a SIGTERM arriving before line(s) {lost} of preemption.py was lost'


def test_a_second_ctrl_c_exits_at_once():
  signals = preemption.StopSignals(install=False)
  signals.handle(signal.SIGINT, None)
  assert signals.agree(None) and signals.agreed == 'SIGINT'
  with pytest.raises(KeyboardInterrupt):
    signals.handle(signal.SIGINT, None)


def test_exit_interval_saves_without_the_checkpoint_callback(tmp_path, caplog):
  import train  # pylint: disable=import-outside-toplevel
  c = parity.parity_config()
  c.trainer.max_steps, c.trainer.exit_interval = 10, 4
  with caplog.at_level('INFO'):
    train.run(c, str(tmp_path))
  assert managers.CheckpointManager(str(tmp_path / 'checkpoints')).committed_steps() == [4]
  assert 'stopped at step 4 by trainer.exit_interval' in caplog.text and 'done:' not in caplog.text


def _saved_run(workdir, steps=(5, 8), **model):
  """A run that saved checkpoints at `steps`, and its config."""
  import train  # pylint: disable=import-outside-toplevel
  c = checkpointed({})
  c.trainer.max_steps = steps[-1]
  c.exp_manager.checkpoint_callback_params.every_n_train_steps = steps[0]
  c.exp_manager.checkpoint_callback_params.save_top_k = -1
  c.model.update(model)
  train.run(c, str(workdir))
  return c


def test_steps_kept_by_val_loss_are_validated_at_each_save_and_resume_takes_the_newest(tmp_path, caplog):
  """monitor=val_loss, mode=max (the worst is kept, so the kept step is not simply the newest),
  save_top_k=1, a save every 2 steps and no periodic validation: every save validates first."""
  import train  # pylint: disable=import-outside-toplevel
  c = checkpointed({}, max_steps=6)
  p = c.exp_manager.checkpoint_callback_params
  p.every_n_train_steps, p.save_top_k, p.monitor, p.mode = 2, 1, 'val_loss', 'max'
  p.filename = 'tiny--{step}-{consumed_samples}'
  c.trainer.limit_val_batches = 1
  train.run(c, str(tmp_path))
  val = {r['step']: r['val_loss'] for r in map(json.loads, open(tmp_path / 'metrics.jsonl')) if 'val_loss' in r}
  assert sorted(val) == [2, 4, 6]
  worst = max(val, key=val.get)
  assert worst != 6
  kept = {worst, 6}                         # the best by the monitor, and the newest (resume_if_exists)
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == sorted(f'tiny--{s}-{8 * s}' for s in kept)
  meta = checkpoint_steps.read_metadata(str(tmp_path / 'checkpoints' / f'tiny--{worst}-{8 * worst}'))
  assert meta['metrics'] == {'val_loss': val[worst]} and meta['step'] == worst
  c.trainer.max_steps = 7
  with caplog.at_level('INFO'):
    train.run(c, str(tmp_path))
  assert 'checkpoints/tiny--6-48: step 6, consumed_samples 48' in caplog.text


def test_resume_with_another_model_shape_refuses_and_keeps_every_step(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  c = _saved_run(tmp_path)
  config_json = (tmp_path / 'config.json').read_text()
  c.model.hidden_size, c.trainer.max_steps = 64, 20
  with pytest.raises(managers.IncompatibleCheckpoint,
                     match=r'embed_tokens.weight: checkpoint \[256, 32\], model \[256, 64\]'):
    train.run(c, str(tmp_path))
  assert managers.CheckpointManager(str(tmp_path / 'checkpoints')).committed_steps() == [5, 8]
  assert (tmp_path / 'config.json').read_text() == config_json      # not overwritten
  c.exp_manager.resume_if_exists = False                             # init_from checks the same
  c.exp_manager.init_from = str(tmp_path / 'checkpoints' / 'step_00000008')
  with pytest.raises(managers.IncompatibleCheckpoint, match='holds a different model'):
    train.run(c, str(tmp_path / 'other'))


def test_resume_without_a_checkpoint_is_an_error_saying_how_to_start_fresh(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  c = checkpointed({})
  c.exp_manager.resume_ignore_no_checkpoint = False                  # NxD Training's default
  with pytest.raises(FileNotFoundError, match='resume_ignore_no_checkpoint=True'):
    train.run(c, str(tmp_path))


def test_a_missing_init_from_names_the_key_and_says_it_does_not_exist(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  c = checkpointed({})
  c.exp_manager.init_from = str(tmp_path / 'nowhere')
  with pytest.raises(store.CheckpointError, match=r'exp_manager.init_from .*nowhere does not exist'):
    train.run(c, str(tmp_path / 'run'))


def test_metrics_after_a_crash_and_resume_hold_each_step_once(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  c = _saved_run(tmp_path)
  shutil.rmtree(tmp_path / 'checkpoints' / 'step_00000008')        # crashed before saving 8
  c.trainer.max_steps = 10
  train.run(c, str(tmp_path))
  steps = [json.loads(line)['step'] for line in open(tmp_path / 'metrics.jsonl') if '"loss"' in line]
  assert steps == list(range(1, 11))


def test_an_unwritable_checkpoint_dir_fails_at_start_naming_it(tmp_path):
  import train  # pylint: disable=import-outside-toplevel
  if os.geteuid() == 0:
    target = '/proc/flatron-checkpoints'                             # root ignores permissions
  else:
    target = str(tmp_path / 'ro')
    os.makedirs(target)
    os.chmod(target, 0o500)
  c = checkpointed({})
  c.exp_manager.checkpoint_dir = target
  with pytest.raises(managers.IncompatibleCheckpoint, match=f'checkpoint directory {target} is not writable'):
    train.run(c, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / 'metrics.jsonl')


def test_init_from_hugging_face_loads_the_weights(tmp_path):
  import torch  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  from model import hf, transformer  # pylint: disable=import-outside-toplevel
  c = parity.parity_config()
  c.trainer.max_steps = 1
  c.model.optim.sched.warmup_steps = 0         # a warm-up needs steps after it
  weights = transformer.init(c.model, 99)
  hf.save_hf(str(tmp_path / 'hf'), c.model, weights)
  c.exp_manager.init_from = str(tmp_path / 'hf')
  c.model.optim.lr = 1e-12                     # one step barely moves them
  c.trainer.gradient_clip_val = 0.0
  _, params = train.run(c, str(tmp_path / 'run'))
  for name, value in weights.items():
    torch.testing.assert_close(params[name].detach(), value.detach(), atol=1e-6, rtol=0)
  c.model.num_layers = 3
  with pytest.raises(managers.IncompatibleCheckpoint, match='model.num_layers: config 3 vs checkpoint 2'):
    train.run(c, str(tmp_path / 'run2'))


def test_an_nxd_checkpoint_resumes_at_this_run_s_layout_with_its_step_and_samples(tmp_path, caplog):
  """resume_from_checkpoint naming an NxD Training checkpoint (saved at tp 2 x pp 2 here): the
  run starts from its weights at its step and data position, says the optimizer starts fresh,
  and once it has saved steps of its own resumes from those."""
  import train  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from checkpoint import nxd_write  # pylint: disable=import-outside-toplevel
  from model import transformer  # pylint: disable=import-outside-toplevel
  c = parity.parity_config()
  weights = transformer.init(c.model, 11)
  nxd_write.write_tag(str(tmp_path / 'nxd'), nxd_write.split(weights, c.model, 2, 2), 'tiny', 5, 5 * c.data.global_batch_size)
  c.exp_manager.resume_from_checkpoint = str(tmp_path / 'nxd')
  c.trainer.max_steps, c.model.optim.lr, c.model.optim.sched.min_lr, c.trainer.gradient_clip_val = 7, 1e-12, 0.0, 0.0
  c.exp_manager.create_checkpoint_callback = True
  c.exp_manager.checkpoint_callback_params.every_n_train_steps = 7
  with caplog.at_level('INFO'):
    _, params = train.run(c, str(tmp_path / 'run'))
  assert 'resumed from NxD checkpoint' in caplog.text and 'optimizer state not carried' in caplog.text
  steps = [json.loads(line)['step'] for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  assert steps == [6, 7]
  vocab = c.model.vocab_size
  for name, value in weights.items():
    torch.testing.assert_close(params[name].detach()[:vocab], value.detach()[:vocab], atol=1e-6, rtol=0)
  c.trainer.max_steps = 8
  caplog.clear()
  with caplog.at_level('INFO'):
    train.run(c, str(tmp_path / 'run'))
  assert 'resumed from' in caplog.text and 'NxD checkpoint' not in caplog.text        # its own step 7
  shutil.copytree(tmp_path / 'nxd', tmp_path / 'nxd_run' / 'checkpoints')     # NxD's own run directory
  c.exp_manager.resume_from_checkpoint, c.exp_manager.resume_if_exists = None, True
  caplog.clear()
  with caplog.at_level('INFO'):
    train.run(c, str(tmp_path / 'nxd_run'))
  assert 'resumed from NxD checkpoint' in caplog.text
  c.exp_manager.resume_if_exists, c.exp_manager.init_from = False, str(tmp_path / 'nxd')        # weight_init_only
  c.trainer.max_steps, c.model.optim.sched.warmup_steps = 1, 0
  _, params = train.run(c, str(tmp_path / 'fine_tune'))
  for name, value in weights.items():
    torch.testing.assert_close(params[name].detach()[:vocab], value.detach()[:vocab], atol=1e-6, rtol=0)


def test_a_step_whose_metadata_is_damaged_is_moved_aside_and_the_one_before_resumes(tmp_path, caplog):
  import train  # pylint: disable=import-outside-toplevel
  c = _saved_run(tmp_path, (5, 10))
  (tmp_path / 'checkpoints' / 'step_00000010' / 'metadata.json').write_text('{ cut sho')
  c.trainer.max_steps = 12
  caplog.clear()
  with caplog.at_level('INFO'):
    train.run(c, str(tmp_path))
  assert 'metadata.json: not valid JSON at line 1 column 3' in caplog.text and 'resumed from' in caplog.text
  assert 'step 5,' in caplog.text.split('resumed from')[1]
  assert os.path.isdir(tmp_path / 'checkpoints' / 'step_00000010.rejected')
