"""parallel/xla.py and the loop on XLA. The runtime keys' mapping runs everywhere; the rest needs
torch-xla (`make test-xla`: its own environment, the CPU PJRT client) and runs each case as
`train.py` in a subprocess with a timeout: XLA equals eager CPU, one compile per graph, bf16
recipes, recompute, checkpoints from and to the device with exact resume."""
import json
import os
import sys

import numpy as np
import pytest

from configs import base
from parallel import xla
from tests import procs

STEPS = 10
slow = pytest.mark.timeout(900)       # compiles on two shared cores: minutes, not the suite's 300 s


# --- runtime keys (no torch-xla needed) --------------------------------------------------


def _settings_config(**keys):
  c = base.get_config()
  for key, value in keys.items():
    c[key] = value
  return c


def test_runtime_keys_are_reported_not_applicable_off_neuron(monkeypatch):
  monkeypatch.setenv('PJRT_DEVICE', 'CPU')
  c = _settings_config(compiler_flags='--model-type transformer', neuron_rt_exec_timeout=600,
                       compiler_cache_url='/tmp/cache')
  cpu = {key: effect for key, _, effect in xla.runtime_settings(c, 'cpu')}
  assert set(cpu) == {'compiler_flags', 'neuron_rt_exec_timeout', 'compiler_cache_url'}
  assert all(effect.startswith('not applicable') for effect in cpu.values())
  on_xla = {key: effect for key, _, effect in xla.runtime_settings(c, 'xla')}
  assert 'NEURON_CC_FLAGS' in on_xla['compiler_flags'] and 'xla (CPU)' in on_xla['compiler_flags']
  assert on_xla['compiler_cache_url'].startswith('persistent compilation cache')
  assert xla.runtime_settings(base.get_config(), 'xla') == []       # unset keys say nothing
  from parallel import device  # pylint: disable=import-outside-toplevel
  auto = {key: effect for key, _, effect in xla.runtime_settings(c, device.kind('auto'))}
  assert 'auto' not in auto['compiler_flags'] and auto['compiler_flags'].endswith(device.kind('auto'))  # the device chosen


def test_runtime_keys_set_the_neuron_environment(monkeypatch):
  monkeypatch.setenv('PJRT_DEVICE', 'NEURON')
  for env in xla.NEURON_ENV.values():
    monkeypatch.delenv(env, raising=False)
  c = _settings_config(compiler_flags='--model-type transformer -O1', aync_exec_max_inflight_requests=7,
                       neuron_rt_exec_timeout=600, neuron_experimental_compress_rg=True)
  settings = xla.configure(c, 'xla')
  assert [effect for _, _, effect in settings] == [f'sets {env}' for env in xla.NEURON_ENV.values()]
  assert os.environ['NEURON_CC_FLAGS'] == '--model-type transformer -O1'
  assert os.environ['NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS'] == '7'
  assert os.environ['NEURON_RT_EXEC_TIMEOUT'] == '600'
  assert os.environ['NEURON_EXPERIMENTAL_COMPRESS_RG'] == '1'


# --- the loop on an XLA device (torch-xla's CPU client) -------------------------------------


def _train(workdir, device, *flags, timeout=420, config='configs/llama_tiny.py:test'):
  """train.py on `config` (llama_tiny:test) in a subprocess; (metrics records, stderr)."""
  env = dict(os.environ, PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1', OMP_NUM_THREADS='1')
  out = procs.run([sys.executable, 'train.py', f'--config={config}', f'--workdir={workdir}',
                   f'--config.device={device}', f'--config.trainer.max_steps={STEPS}',
                   '--config.trainer.log_every_n_steps=1', '--config.exp_manager.create_tensorboard_logger=False',
                   '--config.exp_manager.create_checkpoint_callback=True', *flags],
                  timeout=timeout, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f], out.stderr


def _losses(records):
  return [r['loss'] for r in records if 'loss' in r]


def _final_params(workdir):
  from checkpoint import state  # pylint: disable=import-outside-toplevel
  _, params = state.read_model(os.path.join(workdir, 'checkpoints'))
  return {n: p.float().numpy() for n, p in params.items()}


@pytest.fixture(scope='module')
def eager_fp32(tmp_path_factory):
  pytest.importorskip('torch_xla')
  workdir = str(tmp_path_factory.mktemp('cpu'))
  records, _ = _train(workdir, 'cpu')
  return _losses(records), _final_params(workdir)


@slow
def test_xla_trains_like_eager_cpu(eager_fp32, tmp_path):
  """fp32, 10 steps of llama_tiny: losses and final parameters equal eager CPU's (the parity
  tests' tolerance), after a checkpoint saved from the device."""
  records, _ = _train(str(tmp_path), 'xla')
  losses, params = _losses(records), _final_params(str(tmp_path))
  ref_losses, ref_params = eager_fp32
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
  print(f'XLA vs eager CPU, fp32, {STEPS} steps: worst relative loss error '
        f'{max(abs(a - b) / b for a, b in zip(losses, ref_losses)):.2e}, worst parameter error {worst:.2e}')
  for n in ref_params:
    np.testing.assert_allclose(params[n], ref_params[n], rtol=1e-5, atol=1e-5, err_msg=n)


@slow
def test_no_recompile_after_the_second_step(tmp_path):
  """20 steps with logging every step, validation every 5 (after a sanity pass) and a
  checkpoint at step 10: the compile count never moves after step 2."""
  pytest.importorskip('torch_xla')
  records, _ = _train(str(tmp_path), 'xla', '--config.trainer.max_steps=20', '--config.trainer.val_check_interval=5',
                      '--config.trainer.num_sanity_val_steps=1',
                      '--config.exp_manager.checkpoint_callback_params.every_n_train_steps=10')
  counts = {r['step']: r['xla_compiles'] for r in records if 'xla_compiles' in r}
  assert sorted(counts) == list(range(1, 21))
  print(f'XLA compiles after steps 1, 2 and 20: {counts[1]}, {counts[2]}, {counts[20]}')
  for step in range(3, 21):
    assert counts[step] == counts[2], f'step {step} recompiled: {counts[step] - counts[2]} new graph(s)'
  assert any('val_loss' in r for r in records)
  assert os.path.isdir(os.path.join(str(tmp_path), 'checkpoints'))


@slow
@pytest.mark.parametrize('dropless', [False, True])
def test_moe_on_xla_trains_like_eager_cpu_and_compiles_once(dropless, tmp_path):
  """mixtral_tiny:test, fp32, 10 steps, tokens dropping (capacity 0.5) or dropless, router losses
  on: XLA equals eager CPU, and no step after the second compiles a new graph (no
  data-dependent shape reaches XLA)."""
  pytest.importorskip('torch_xla')
  # the z-loss weight above the peak lr (0.01): torch-xla gives equal Python scalars one graph
  # input, so a step whose lr equalled it would trace a new graph; sanity validation compiles the
  # evaluation graphs before step 1
  flags = ('--config.model.moe.capacity_factor=0.5', f'--config.model.moe.dropless={dropless}',
           '--config.model.moe.router_z_loss_coef=0.05', '--config.trainer.num_sanity_val_steps=1')
  cpu, xla_dir = str(tmp_path / 'cpu'), str(tmp_path / 'xla')
  # eager CPU in the same fixed-size buffers (that they equal the sorted dispatch: test_experts.py)
  ref, _ = _train(cpu, 'cpu', *flags, '--config.model.moe.fixed_buffers=True', config='configs/mixtral_tiny.py:test')
  records, _ = _train(xla_dir, 'xla', *flags, config='configs/mixtral_tiny.py:test')
  losses, ref_losses = _losses(records), _losses(ref)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  params, ref_params = _final_params(xla_dir), _final_params(cpu)
  counts = [r['xla_compiles'] for r in records if 'xla_compiles' in r]
  worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
  print(f'MoE on XLA (dropless={dropless}): worst relative loss error '
        f'{max(abs(a - b) / b for a, b in zip(losses, ref_losses)):.2e}, worst parameter error {worst:.2e}, '
        f'compiles after each step {counts}')
  assert counts[2:] == [counts[1]] * (len(counts) - 2), counts
  # at capacity 0.5 an expert may see a handful of tokens a step: Adam divides their small
  # gradient sums by sqrt(v), which carries a rounding difference to ~2e-5 in a single element
  atol = 1e-5 if dropless else 5e-5
  for n in ref_params:
    np.testing.assert_allclose(params[n], ref_params[n], rtol=1e-5, atol=atol, err_msg=n)


@pytest.mark.timeout(1500)    # its first step compiles for minutes on two shared cores
@pytest.mark.parametrize('family', ['gpt_oss', 'deepseek_v3', 'llama4'])
def test_the_2026_moe_families_on_xla_train_like_eager_cpu(family, tmp_path):
  """The tests' small gpt-oss (sinks, sliding and full layers, biases, the clamped SwiGLU),
  DeepSeek-V3 (latent attention, grouped sigmoid routing, its correction biases moved each step
  from a device-side count) and Llama 4 (chunks, NoPE layers with the temperature, top-1 experts
  scaling their input), from their HF config.json, fp32, two layers (one of each kind): XLA
  equals eager CPU in the same fixed-size buffers, and no step after the second compiles a new graph."""
  pytest.importorskip('torch_xla')
  from model import hf_export  # pylint: disable=import-outside-toplevel
  from tests import parity  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'config.json'
  model = parity.parity_config(family=family, layers=2).model
  model.moe.dense_layers = ()           # both layers MoE (DeepSeek's and Llama 4's first is dense)
  path.write_text(json.dumps(hf_export.config_to_hf(model)))
  flags = ('--config.model_source=hf', f'--config.model.model_config={path}', '--config.trainer.val_check_interval=0',
           f'--config.model.moe.load_balance_rate={0.05 if family == "deepseek_v3" else 0.0}')
  cpu, xla_dir = str(tmp_path / 'cpu'), str(tmp_path / 'xla')
  ref, _ = _train(cpu, 'cpu', *flags, '--config.model.moe.fixed_buffers=True')
  records, _ = _train(xla_dir, 'xla', *flags, timeout=1200)
  losses, ref_losses = _losses(records), _losses(ref)
  params, ref_params = _final_params(xla_dir), _final_params(cpu)
  counts = [r['xla_compiles'] for r in records if 'xla_compiles' in r]
  worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
  print(f'{family} on XLA: worst relative loss error {max(abs(a - b) / b for a, b in zip(losses, ref_losses)):.2e}, '
        f'worst parameter error {worst:.2e}, compiles after each step {counts}')
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert counts[2:] == [counts[1]] * (len(counts) - 2), counts
  for n in ref_params:
    np.testing.assert_allclose(params[n], ref_params[n], rtol=1e-5, atol=1e-5, err_msg=n)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize('recipe', ['bf16SR', 'mixed_precision'])
def test_bf16_recipes_train_on_xla(recipe, tmp_path):
  """bf16 with stochastic rounding, and bf16 with fp32 masters: they train on XLA, close to eager."""
  pytest.importorskip('torch_xla')
  # 4 steps: stochastic rounding's bit reinterpretation (view as int32) falls back to the CPU on
  # torch-xla 2.9, so the first two steps compile a few graphs per parameter shape (cached after).
  records, stderr = _train(str(tmp_path), 'xla', f'--config.precision.type={recipe}', '--config.trainer.max_steps=4',
                           '--config.model.optim.sched.warmup_steps=1', timeout=1100)
  losses, counts = _losses(records), [r['xla_compiles'] for r in records if 'xla_compiles' in r]
  print(f'{recipe} on XLA: losses {losses}, compiles after each step {counts}')
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses
  assert counts[2:] == [counts[1]] * (len(counts) - 2) and 'new graph' not in stderr


@slow
def test_full_recompute_on_xla_equals_no_recompute(eager_fp32, tmp_path):
  """torch_xla's checkpoint under model.activations_checkpoint_granularity=full: the same steps."""
  records, _ = _train(str(tmp_path), 'xla', '--config.model.activations_checkpoint_granularity=full')
  np.testing.assert_allclose(_losses(records), eager_fp32[0], rtol=1e-5)


@slow
def test_resume_on_xla_is_exact(tmp_path):
  """Stop at step 5 (checkpoint from the device), resume to 10 (load to the device): the final
  parameters equal an uninterrupted run's bit for bit."""
  pytest.importorskip('torch_xla')
  straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
  _train(straight, 'xla')
  _train(resumed, 'xla', '--config.trainer.exit_interval=5')
  _train(resumed, 'xla', '--config.exp_manager.resume_if_exists=True')
  a, b = _final_params(straight), _final_params(resumed)
  for n in a:
    np.testing.assert_array_equal(a[n], b[n], err_msg=n)


NONFINITE_STEP = '''
import torch, torch_xla
from configs import llama_tiny
from data.loader import Loader
from model import transformer
from optim import update
from parallel import mesh as meshes, tensor, training
c = llama_tiny.get_config('test')
c.trainer.nonfinite_policy = 'skip'
mesh = meshes.Mesh(device=torch_xla.device())
params = transformer.init(c.model, 0, device=mesh.device)
with torch.no_grad():
  params['layers.0.mlp.up_proj.weight'][0, 0] = float('nan')
before = {k: v.detach().cpu().clone() for k, v in params.items()}
updater = update.Updater(params, c, mesh)
out = training.train_step(params, updater, Loader(c).global_batch(0), c, 0, mesh, tensor.make_ops(mesh))
torch_xla.sync()
assert torch.is_tensor(out['skipped']) and bool(out['skipped'].cpu())
for k, v in params.items():
  torch.testing.assert_close(v.detach().cpu(), before[k], equal_nan=True, rtol=0, atol=0)
print('skipped in the graph')
'''


@slow
def test_nonfinite_update_is_skipped_in_the_graph():
  """On XLA the finite check is no host sync: the update runs and is selected away in the
  graph, leaving parameters (and optimizer state) exactly as they were."""
  pytest.importorskip('torch_xla')
  out = procs.run([sys.executable, '-c', NONFINITE_STEP], timeout=600,
                  env=dict(os.environ, PJRT_DEVICE='CPU', PYTHONPATH=procs.ROOT))
  assert out.returncode == 0 and 'skipped in the graph' in out.stdout, out.stderr[-3000:]
