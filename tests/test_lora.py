"""LoRA (model/lora.py): peft as the oracle for the forward pass and the gradients, init, every
layout trains like one device, frozen base, adapter-only checkpoints and their resume, config
validation (peft directories and the merged export: tests/test_adapters.py)."""
import copy
import json
import os
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from checkpoint import manager as managers, state as states, steps as checkpoint_steps
from configs import base, validate
from model import adapters, hf, lora, lora_targets, param_table, transformer
from optim import update
from parallel import mesh as meshes, tensor
from tests import parity
from tools import convert

os.environ.setdefault('HF_HUB_OFFLINE', '1')
transformers = pytest.importorskip('transformers')
peft_lib = pytest.importorskip('peft')

VOCAB = 300                   # not a multiple of the padding: our logits carry padded columns
TARGETS = {'qkv': (('qkv_proj',), ['q_proj', 'k_proj', 'v_proj']),     # ours, peft's
           'all': (('all-linear',), 'all-linear')}


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
  """tied -> an HF Llama directory (hidden 64, GQA, vocab 300)."""
  out = {}
  for tied in (False, True):
    out[tied] = str(tmp_path_factory.mktemp(f'hf_tied{int(tied)}'))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=tied)).float().eval().save_pretrained(out[tied])
  return out


def hf_model(path):
  return transformers.LlamaForCausalLM.from_pretrained(path).float().eval()


def with_peft(path, targets, rslora, seed=1):
  """peft around the HF model at `path` (r 4, alpha 8), every lora_A / lora_B random and non-zero."""
  model = peft_lib.get_peft_model(hf_model(path), peft_lib.LoraConfig(
      r=4, lora_alpha=8, target_modules=TARGETS[targets][1], use_rslora=rslora))
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'lora_' in name:
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
  return model


def ours_like(path, model, targets, rslora):
  """(model section, params): the HF base plus the peft model's adapters, set in our config."""
  cfg, params = hf.load_hf(path, base.get_config().model)
  cfg.peft.update(dict(lora_rank=4, lora_alpha=8.0, use_rslora=rslora, target_modules=TARGETS[targets][0]))
  theirs = dict(model.named_parameters())
  names = [n for n in param_table.param_specs(cfg) if lora.is_adapter(n)]
  for name in names:
    key = adapters.peft_key(name).replace('.weight', '.default.weight')
    params[name] = theirs[key].detach().clone()
  assert len(names) == sum('lora_' in k for k in theirs) > 0
  return cfg, params


def logits(params, cfg, ids):
  with torch.no_grad():
    return transformer.forward(params, ids, cfg)[..., :VOCAB]


def max_err(a, b):
  return float((a - b).abs().max())


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
ORACLE_CASES = [('qkv', False, False), ('qkv', True, False), ('all', False, False), ('all', True, False),
                ('all', True, True)]


# --- 1, 2: peft as the oracle ---------------------------------------------------------------


@pytest.mark.parametrize('targets,rslora,tied', ORACLE_CASES)
def test_logits_equal_peft(hf_dirs, targets, rslora, tied):
  model = with_peft(hf_dirs[tied], targets, rslora)
  cfg, params = ours_like(hf_dirs[tied], model, targets, rslora)
  with torch.no_grad():
    theirs = model(IDS).logits
  err = max_err(logits(params, cfg, IDS), theirs)
  base_err = max_err(logits({n: p for n, p in params.items() if not lora.is_adapter(n)}, cfg, IDS), theirs)
  print(f'logits vs peft ({targets}, rslora={rslora}, tied={tied}): {err:.2e} (without adapters {base_err:.2e})')
  assert err < 1e-5 and base_err > 1e-2          # the adapters matter, and match


@pytest.mark.parametrize('targets,rslora', [('qkv', False), ('all', True)])
def test_adapter_gradients_equal_peft(hf_dirs, targets, rslora):
  model = with_peft(hf_dirs[False], targets, rslora).train()
  cfg, params = ours_like(hf_dirs[False], model, targets, rslora)
  for name, p in params.items():
    p.requires_grad_(lora.is_adapter(name))
  batch = {'tokens': IDS[:, :-1], 'labels': IDS[:, 1:], 'loss_mask': torch.ones(IDS[:, 1:].shape)}
  ours = transformer.loss_sum(params, batch, cfg) / batch['loss_mask'].sum()
  ours.backward()
  theirs = F.cross_entropy(model(IDS[:, :-1]).logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
  theirs.backward()
  named = dict(model.named_parameters())
  worst = 0.0
  for name in (n for n in params if lora.is_adapter(n)):
    g = named[adapters.peft_key(name).replace('.weight', '.default.weight')].grad
    torch.testing.assert_close(params[name].grad, g, atol=1e-5, rtol=0, msg=name)
    worst = max(worst, max_err(params[name].grad, g))
    assert float(g.abs().max()) > 1e-4, name         # every factor gets a real gradient
  assert all(p.grad is None for n, p in params.items() if not lora.is_adapter(n))
  print(f'gradients vs peft ({targets}, rslora={rslora}): loss {abs(ours.item() - theirs.item()):.2e}, '
        f'worst gradient error {worst:.2e}')
  assert abs(ours.item() - theirs.item()) < 1e-5


# --- 3: init -----------------------------------------------------------------------------------


def test_init_is_the_base_model_and_keyed():
  cfg = parity.parity_config(lora=4).model
  params = transformer.init(cfg, 7)
  base_params = transformer.init(parity.parity_config().model, 7)
  assert set(params) - set(base_params) == {n for n in params if lora.is_adapter(n)}
  assert len([n for n in params if lora.is_adapter(n)]) == 2 * 7 * cfg.num_layers
  ids = IDS[:, :8] % cfg.vocab_size
  assert torch.equal(logits(params, cfg, ids), logits(base_params, cfg, ids))   # B = 0: exactly the base
  specs = param_table.param_specs(cfg)
  for name, p in params.items():
    if lora.split_name(name) and lora.split_name(name)[1] == 'lora_A':
      bound = 1 / np.sqrt(specs[name].shape[1])
      assert p.dtype == torch.float32 and p.abs().max() <= bound and p.abs().max() > 0.8 * bound, name
      assert abs(p.std().item() - bound / np.sqrt(3)) < 0.25 * bound, name   # uniform, not normal
    elif lora.is_adapter(name):
      assert not p.any(), name
  a = [p for n, p in params.items() if n.endswith('lora_A.weight')]
  assert not torch.equal(a[0][:, :32], a[1][:, :32])                       # keyed by name
  again = transformer.init(cfg, 7)
  assert all(torch.equal(again[n], params[n]) for n in params)               # and by seed
  assert not torch.equal(transformer.init(cfg, 8)['layers.0.mlp.down_proj.lora_A.weight'],
                         params['layers.0.mlp.down_proj.lora_A.weight'])
  for rank in range(2):                    # a TP box is that slice of the whole init
    boxes = tensor.boxes(cfg, meshes.Mesh(tp=2, rank=rank))
    mine = transformer.init(cfg, 7, boxes=boxes, tp=2)
    for name in (n for n in params if lora.is_adapter(n)):
      assert torch.equal(mine[name], params[name][boxes[name]]), name
    assert boxes['layers.0.self_attn.q_proj.lora_B.weight'][0] != slice(0, cfg.hidden_size)   # B split
    assert boxes['layers.0.mlp.down_proj.lora_A.weight'][1] != slice(0, cfg.ffn_hidden_size)  # A split


# --- 5: every layout trains like one device --------------------------------------------------

LORA_LAYOUTS = {
    'lora_tp2': (2, {'tp': 2}),
    'lora_pp2': (2, {'pp': 2}),
    'lora_dp2_zero1': (2, {'zero1': True}),
    'lora_tp2_sp': (2, {'tp': 2, 'sp': True}),
    'lora_tp2_dropout': (2, {'tp': 2, 'lora_dropout': 0.1}),
}


def test_lora_at_every_layout_trains_like_one_device(tmp_path, tmp_path_factory):
  """Split and replicated factors, the row-parallel adapter joining the base's reduction, the
  TP sum of replicated factors' gradients, keyed adapter dropout: one device's update (every
  layout, one after another in one spawned world: all are 2 ranks)."""
  layouts = {name: (world_size, dict(kwargs, lora=4)) for name, (world_size, kwargs) in LORA_LAYOUTS.items()}
  trained = parity.check_layouts(layouts, tmp_path, tmp_path_factory)
  without = parity.reference(tmp_path_factory, lora=4)[0]
  assert without != parity.reference(tmp_path_factory, lora=4, lora_dropout=0.1)[0]   # the adapter dropout acted
  for layout, params in trained.items():
    config = parity.parity_config(**layouts[layout][1])
    init = transformer.init(config.model, config.seed)
    for name, value in params.items():
      start = init[name].detach().numpy()[:value.shape[0]]
      if lora.is_adapter(name):
        assert np.abs(value - start).max() > 1e-3, f'{layout}: {name}'                  # trained
      else:
        np.testing.assert_array_equal(value, start, err_msg=f'{layout}: {name}')        # frozen, bit for bit


# --- 6, 7: frozen base and checkpoints in the loop -------------------------------------------


def lora_config(init_from, max_steps=10, exit_interval=0, **peft):
  c = parity.parity_config(lora=4)
  c.trainer.max_steps, c.trainer.exit_interval = max_steps, exit_interval
  c.exp_manager.create_checkpoint_callback = True
  c.exp_manager.checkpoint_callback_params.every_n_train_steps = 5
  c.exp_manager.resume_if_exists = c.exp_manager.resume_ignore_no_checkpoint = True
  c.exp_manager.init_from = init_from
  c.model_alignment_strategy.peft.update(peft)
  return c


def losses(workdir):
  return [json.loads(line)['loss'] for line in open(os.path.join(workdir, 'metrics.jsonl')) if '"loss"' in line]


def step_path(workdir, step):
  return os.path.join(workdir, 'checkpoints', checkpoint_steps.step_dir(step))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """A base model (an HF directory), a LoRA run of 10 steps straight (and its Updater), and
  one that stops at 5 and resumes to 10."""
  root = tmp_path_factory.mktemp('runs')
  base_cfg = parity.parity_config().model
  weights = transformer.init(base_cfg, 99)
  hf.save_hf(str(root / 'hf'), base_cfg, weights)
  made, original = [], update.Updater

  class Recorded(original):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(update, 'Updater', Recorded)
    _, straight = train.run(lora_config(str(root / 'hf')), str(root / 'straight'))
  train.run(lora_config(str(root / 'hf'), exit_interval=5), str(root / 'resumed'))
  _, resumed = train.run(lora_config(str(root / 'hf')), str(root / 'resumed'))
  return {'root': root, 'weights': weights, 'straight': straight, 'resumed': resumed, 'updater': made[0]}


def test_only_the_adapters_train(runs):
  u = runs['updater']
  names = [n for n in runs['straight'] if lora.is_adapter(n)]
  assert u.trainable == names and set(u.master) == set(names)
  assert {id(m) for m in u.master.values()} == {id(m) for m in u.optimizer.state} and u.optimizer.state
  assert all('lora_' in n for n in u.named_state())
  for name, p in runs['straight'].items():
    if not lora.is_adapter(name):
      assert p.grad is None and not p.requires_grad, name
      assert torch.equal(p.detach()[:runs['weights'][name].shape[0]], runs['weights'][name].detach()), name


def test_resume_of_adapter_only_checkpoints_is_bitwise(runs):
  root = runs['root']
  assert losses(root / 'resumed') == losses(root / 'straight')      # identical floats
  assert len(losses(root / 'straight')) == 10
  for name, p in runs['straight'].items():
    assert torch.equal(p, runs['resumed'][name]), name
  meta = checkpoint_steps.read_metadata(step_path(root / 'resumed', 5))
  assert meta['lora'] == {'stored': 'adapters'}
  arrays = set(meta['arrays'])
  adapter_names = {n for n in runs['straight'] if lora.is_adapter(n)}
  assert {a for a in arrays if not a.startswith('optim.')} == adapter_names       # no base weights
  assert {a.split('.', 2)[2] for a in arrays if a.startswith('optim.')} == adapter_names
  assert {a.split('.', 2)[1] for a in arrays if a.startswith('optim.')} == {'exp_avg', 'exp_avg_sq'}


def test_resume_without_the_base_says_so(runs):
  workdir = runs['root'] / 'resumed'
  with pytest.raises(managers.IncompatibleCheckpoint, match='holds LoRA adapters only; set exp_manager.init_from'):
    train.run(lora_config(None, max_steps=12), str(workdir))


def test_flatron_to_hf_and_export_peft_of_a_lora_step(runs, tmp_path):
  root, params = runs['root'], runs['straight']
  cfg = lora_config(None).model
  ids = IDS % cfg.vocab_size
  with torch.no_grad():
    ours = transformer.forward(params, ids, cfg)[..., :cfg.vocab_size]
  config, read = states.read_model(step_path(root / 'straight', 10))           # base from init_from
  assert all(torch.equal(read[n], params[n].detach()) for n in params)
  convert.flatron_to_hf(step_path(root / 'straight', 10), str(tmp_path / 'merged'))
  convert.export_peft(step_path(root / 'straight', 10), str(tmp_path / 'adapter'))
  loaded = peft_lib.PeftModel.from_pretrained(hf_model(str(root / 'hf')), str(tmp_path / 'adapter')).eval()
  with torch.no_grad():
    err_merged = max_err(ours, hf_model(str(tmp_path / 'merged'))(ids).logits)
    err_peft = max_err(ours, loaded(ids).logits)
  print(f'trained LoRA step: flatron-to-hf (merged) {err_merged:.2e}, export-peft {err_peft:.2e}')
  assert err_merged < 1e-5 and err_peft < 1e-5 and config.model.peft.lora_rank == 4


@pytest.mark.parametrize('option,stored', [('save_lora_base', 'adapters+base'), ('merge_lora', 'merged')])
def test_base_and_merged_checkpoints(runs, tmp_path, option, stored):
  config = lora_config(str(runs['root'] / 'hf'), exit_interval=2, **{option: True})
  _, params = train.run(config, str(tmp_path))
  meta = checkpoint_steps.read_metadata(step_path(tmp_path, 2))
  assert meta['lora'] == {'stored': stored}
  names = {a for a in meta['arrays'] if not a.startswith(('optim.', 'master.'))}
  specs = param_table.param_specs(config.model)
  if option == 'save_lora_base':
    assert names == set(specs)
    expected = params
  else:
    assert names == {n for n in specs if not lora.is_adapter(n)} and names == set(meta['arrays'])
    expected = lora.merged({n: p.detach() for n, p in params.items()}, config.model)
    assert not torch.equal(expected['layers.0.mlp.down_proj.weight'], params['layers.0.mlp.down_proj.weight'])
  _, read = states.read_model(step_path(tmp_path, 2))
  assert read.keys() == expected.keys()
  for name, value in expected.items():
    assert torch.equal(read[name], value.detach()), name


# --- 8: config validation ------------------------------------------------------------------


@pytest.mark.parametrize('setting,expected', [
    ({'target_modules': ('qkv_proj', 'qkv')}, "target_modules: 'qkv' is unknown"),
    ({'lora_bias': 'x'}, "model_alignment_strategy.peft.lora_bias='x' is unknown"),
    ({'merge_lora': True, 'save_lora_base': True}, 'merge_lora and save_lora_base both set'),
    ({'lora_dropout': 1.0}, 'model_alignment_strategy.peft.lora_dropout=1.0'),
    ({'load_lora_from_ckpt': True}, 'model_alignment_strategy.peft.load_lora_from_ckpt needs lora_save_dir'),
])
def test_config_validation_names_the_key(setting, expected):
  c = parity.parity_config(lora=4)
  assert not [p for p in validate.check(c) if 'peft' in p]
  c.model_alignment_strategy.peft.update(setting)
  problems = validate.check(c)
  assert any(expected in p for p in problems), problems


def test_target_module_names():
  peft = copy.deepcopy(parity.parity_config(lora=4).model.peft)
  peft.target_modules = ('o_proj', 'gate_up_proj', 'q_proj')
  assert lora_targets.target_modules(peft) == ('q_proj', 'o_proj', 'gate_proj', 'up_proj')
  peft = types.SimpleNamespace(target_modules='all-linear')          # a plain string too
  assert lora_targets.target_modules(peft) == lora_targets.MODULES


@pytest.mark.parametrize('source', ['peft_dir', 'flatron_step'])
def test_load_lora_from_ckpt_starts_from_those_adapters(runs, tmp_path, source):
  root, trained = runs['root'], runs['straight']
  step = step_path(root / 'straight', 10)
  path = str(tmp_path / 'adapter') if source == 'peft_dir' else step
  if source == 'peft_dir':
    convert.export_peft(step, path)
  config = lora_config(str(root / 'hf'), load_lora_from_ckpt=True, lora_save_dir=path)
  config.exp_manager.create_checkpoint_callback = False
  with pytest.MonkeyPatch.context() as mp:         # stop before the first step: the starting params
    mp.setattr(train, '_loop', lambda *args, **kwargs: {})
    _, start = train.run(config, str(tmp_path / 'run'))
  for name, p in trained.items():
    assert torch.equal(start[name].detach(), p.detach()), name    # adapters loaded, base from init_from


def test_latent_attention_adapts_its_own_projections_and_refuses_names_it_lacks():
  """DeepSeek-V3's latent attention: all-linear adapts its q_a/q_b/kv_a/kv_b projections and o_proj
  (peft's all-linear takes every nn.Linear); q/k/v_proj name modules it has not: refused by name."""
  from configs import validate  # pylint: disable=import-outside-toplevel
  from model import lora_targets, param_table  # pylint: disable=import-outside-toplevel
  c = parity.parity_config(family='deepseek_v3', layers=4, lora=4)
  assert validate.check(c, 1) == []
  planned = lora_targets.plan(c.model, param_table.param_specs(c.model))
  assert {n.rsplit('.', 1)[-1] for n in planned if n.startswith('layers.1.self_attn.')} == \
      {'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj'}
  c.model_alignment_strategy.peft.target_modules = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
  assert "(model.mla): it has no k_proj, q_proj, v_proj; its projections are q_a_proj, q_b_proj, " \
      "kv_a_proj_with_mqa, kv_b_proj and o_proj" in '\n'.join(validate.check(c, 1))
