"""model/adapters.py and the adapter settings a run takes from a starting adapter
(configs/from_files.py: resolve_adapter_settings): every adapter_config.json field peft writes
is honoured or refused by name, through the three paths that read one (load_lora_from_ckpt,
generate --adapter, merge-peft), with peft's logits as the oracle; ours -> peft, peft -> ours and
the merged export keep the logits; DPO from a loaded adapter keeps that adapter as its
reference, as trl does."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from checkpoint import manager as managers
from configs import from_files
from model import adapters, hf, lora, lora_targets, transformer
from tests import parity
from tests.test_lora import IDS as LORA_IDS, hf_dirs, max_err, ours_like, with_peft  # pylint: disable=unused-import

os.environ.setdefault('HF_HUB_OFFLINE', '1')
transformers = pytest.importorskip('transformers')
peft_lib = pytest.importorskip('peft')

IDS = torch.tensor([[3, 17, 91, 200, 5, 44, 130, 9, 250, 1, 77, 60]])

# peft LoraConfig settings: every option that changes what the adapter computes.
CASES = {
    'rslora_alpha32': dict(r=4, lora_alpha=32, use_rslora=True, target_modules=['q_proj', 'v_proj']),
    'regex': dict(r=4, lora_alpha=8, target_modules=r'.*\.layers\.1\.(self_attn\.k_proj|mlp\.down_proj)'),
    'rank_alpha_patterns': dict(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj', 'down_proj'],
                                rank_pattern={'q_proj': 2, 'model.layers.1.mlp.down_proj': 6},
                                alpha_pattern={'v_proj': 3}),
    'paths_bias_dropout': dict(r=2, lora_alpha=4, target_modules=['model.layers.0.self_attn.k_proj', 'o_proj'],
                               bias='lora_only', lora_dropout=0.1),
    'layers_to_transform': dict(r=3, lora_alpha=6, target_modules=['gate_proj', 'up_proj'], layers_to_transform=[1]),
}


@pytest.fixture(scope='module')
def base_dir(tmp_path_factory):
  """An HF Llama directory of parity_config's model (random weights)."""
  path = str(tmp_path_factory.mktemp('base'))
  cfg = parity.parity_config().model
  hf.save_hf(path, cfg, transformer.init(cfg, 7))
  return path


def hf_model(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()


def peft_adapter(base_dir, path, seed=1, **settings):
  """A peft adapter of `settings` around the base, every factor random, saved at `path`."""
  model = peft_lib.get_peft_model(hf_model(base_dir), peft_lib.LoraConfig(**settings))
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'lora_' in name:
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
  model.eval().save_pretrained(path)
  return model


def logits(params, cfg, ids=IDS):
  with torch.no_grad():
    return transformer.forward(params, ids, cfg)[..., :cfg.vocab_size]


def lora_run_config(base_dir, adapter_dir, rank, **peft):
  """parity_config with LoRA of rank `rank` starting from `adapter_dir`; the other LoRA settings unset."""
  c = parity.parity_config(lora=rank)
  c.exp_manager.init_from = base_dir
  p = c.model_alignment_strategy.peft
  p.lora_alpha = p.lora_dropout = p.target_modules = None
  p.update(dict(load_lora_from_ckpt=True, lora_save_dir=adapter_dir, **peft))
  return c


def starting_params(config, workdir):
  """train.run up to the first step: the config as resolved and the starting parameters."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train, '_loop', lambda *args, **kwargs: {})
    _, params = train.run(config, workdir)
  return config, {n: p.detach() for n, p in params.items()}


@pytest.mark.parametrize('case', sorted(CASES))
def test_every_peft_option_loads_through_all_three_paths_with_peft_logits(case, base_dir, tmp_path):
  from tools import convert    # pylint: disable=import-outside-toplevel
  settings, adapter_dir = CASES[case], str(tmp_path / 'adapter')
  with torch.no_grad():
    expected = peft_adapter(base_dir, adapter_dir, **settings)(IDS).logits
  cfg, base = hf.load_hf(base_dir)
  # generate --adapter
  cfg_g, params_g = adapters.load_peft(adapter_dir, cfg, base)
  # merge-peft
  convert.merge_peft(adapter_dir, base_dir, str(tmp_path / 'merged'))
  with torch.no_grad():
    merged = hf_model(str(tmp_path / 'merged'))(IDS).logits
  # load_lora_from_ckpt, every LoRA setting but the rank left to the adapter
  config, params = starting_params(lora_run_config(base_dir, adapter_dir, settings['r']), str(tmp_path / 'run'))
  errors = {'generate': (logits(params_g, cfg_g) - expected).abs().max().item(),
            'merge-peft': (merged - expected).abs().max().item(),
            'load_lora_from_ckpt': (logits(params, config.model) - expected).abs().max().item()}
  print(case, {k: f'{v:.1e}' for k, v in errors.items()})
  assert max(errors.values()) < 1e-5, errors
  peft = config.model.peft
  assert (peft.lora_alpha, peft.use_rslora, peft.lora_bias, peft.lora_dropout) == (
      settings['lora_alpha'], settings.get('use_rslora', False), settings.get('bias', 'none'),
      settings.get('lora_dropout', 0.0))
  adapted = {n for n in params if lora.is_adapter(n)}
  assert len(adapted) == 2 * sum(1 for k in expected_keys(adapter_dir) if 'lora_A' in k)


def expected_keys(adapter_dir):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  with safe_open(os.path.join(adapter_dir, adapters.WEIGHTS_FILE), framework='pt') as f:
    return list(f.keys())


def test_export_peft_writes_what_peft_reads_back(base_dir, tmp_path):
  settings = CASES['rank_alpha_patterns']
  adapter_dir = str(tmp_path / 'theirs')
  peft_adapter(base_dir, adapter_dir, **settings)
  cfg, params = adapters.load_peft(adapter_dir, *hf.load_hf(base_dir))
  adapters.save_peft(str(tmp_path / 'ours'), cfg, params, base_model_name_or_path=base_dir)
  loaded = peft_lib.PeftModel.from_pretrained(hf_model(base_dir), str(tmp_path / 'ours')).eval()
  with torch.no_grad():
    assert (loaded(IDS).logits - logits(params, cfg)).abs().max().item() < 1e-5
  written = json.load(open(tmp_path / 'ours' / adapters.CONFIG_FILE))
  assert written['rank_pattern'] == settings['rank_pattern'] and written['alpha_pattern'] == {'v_proj': 3.0}


def test_peft_directory_and_merged_export_round_trip(hf_dirs, tmp_path):
  from tools import convert    # pylint: disable=import-outside-toplevel
  hf_dir = hf_dirs[False]
  cfg, params = ours_like(hf_dir, with_peft(hf_dir, 'all', True), 'all', True)
  ours = logits(params, cfg, LORA_IDS)
  adapters.save_peft(str(tmp_path / 'adapter'), cfg, params, base_model_name_or_path=hf_dir)   # ours -> peft
  loaded = peft_lib.PeftModel.from_pretrained(hf_model(hf_dir), str(tmp_path / 'adapter')).eval()
  with torch.no_grad():
    err_peft = max_err(ours, loaded(LORA_IDS).logits)
  model = with_peft(hf_dir, 'all', False, seed=5)                  # peft -> ours
  model.save_pretrained(str(tmp_path / 'theirs'))
  cfg2, params2 = adapters.load_peft(str(tmp_path / 'theirs'), cfg, hf.load_hf(hf_dir, cfg)[1])
  assert (cfg2.peft.lora_rank, cfg2.peft.lora_alpha, cfg2.peft.use_rslora) == (4, 8.0, False)
  assert lora_targets.target_modules(cfg2.peft) == lora_targets.MODULES
  with torch.no_grad():
    err_ours = max_err(logits(params2, cfg2, LORA_IDS), model(LORA_IDS).logits)
  hf.save_hf(str(tmp_path / 'merged'), cfg, lora.merged(params, cfg))    # merged: a plain Llama
  with torch.no_grad():
    err_merged = max_err(ours, hf_model(str(tmp_path / 'merged'))(LORA_IDS).logits)
  convert.merge_peft(str(tmp_path / 'adapter'), hf_dir, str(tmp_path / 'merged2'))
  with torch.no_grad():
    err_merge_peft = max_err(ours, hf_model(str(tmp_path / 'merged2'))(LORA_IDS).logits)
  print(f'export: ours -> peft {err_peft:.2e}, peft -> ours {err_ours:.2e}, merged {err_merged:.2e}, '
        f'merge-peft {err_merge_peft:.2e}')
  assert max(err_peft, err_ours, err_merged, err_merge_peft) < 1e-5
  config = json.load(open(tmp_path / 'adapter' / adapters.CONFIG_FILE))
  assert (config['r'], config['use_rslora'], config['base_model_name_or_path']) == (4, True, hf_dir)


@pytest.mark.parametrize('setting,message', [
    ({'lora_alpha': 16.0}, 'lora_alpha: this run 16.0, the adapter 32.0'),
    ({'use_rslora': False}, 'use_rslora: this run False, the adapter True'),
    ({'target_modules': ('qkv_proj',)}, 'layers.0.self_attn.k_proj: this run rank 4, the adapter none'),
    ({'rank_pattern': (('v_proj', 2),)}, "rank_pattern: this run (('v_proj', 2),), the adapter"),
])
def test_a_run_setting_that_differs_from_the_adapter_is_refused_with_both_values(base_dir, tmp_path, setting, message):
  adapter_dir = str(tmp_path / 'adapter')
  peft_adapter(base_dir, adapter_dir, **CASES['rslora_alpha32'])
  config = lora_run_config(base_dir, adapter_dir, 4, **setting)
  with pytest.raises(managers.IncompatibleCheckpoint) as e:
    from_files.resolve_adapter_settings(config)
  assert message in str(e.value)


@pytest.mark.parametrize('field,value', [('use_dora', True), ('layer_replication', [[0, 1]]),
                                         ('exclude_modules', ['q_proj']), ('modules_to_save', ['lm_head']),
                                         ('layers_pattern', 'blocks'), ('peft_type', 'IA3')])
def test_adapter_fields_that_change_the_math_are_refused_by_name(base_dir, tmp_path, field, value):
  adapter_dir = str(tmp_path / 'adapter')
  peft_adapter(base_dir, adapter_dir, **CASES['rslora_alpha32'])
  path = os.path.join(adapter_dir, adapters.CONFIG_FILE)
  written = json.load(open(path))
  written[field] = value
  json.dump(written, open(path, 'w'))
  with pytest.raises(ValueError, match=f'not supported here: {field}'):
    adapters.read_settings(adapter_dir)
  with pytest.raises(ValueError, match=field):
    from_files.resolve_adapter_settings(lora_run_config(base_dir, adapter_dir, 4))


# --- DPO from a loaded adapter ---------------------------------------------------------------


@pytest.fixture(scope='module')
def pairs(tmp_path_factory):
  """8 pre-tokenized pairs: exactly one global batch, so step 1 sees all of them."""
  path = tmp_path_factory.mktemp('pairs') / 'pairs.jsonl'
  rows = parity.write_pairs(path, 8, seed=3, chosen_ids=(0, 256), rejected_ids=(0, 256), prompt_ids=(0, 256))
  return str(path), rows


def response_logp(model, prompt, response):
  ids = torch.tensor([prompt + response])
  with torch.no_grad():
    logp = F.log_softmax(model(ids).logits[0, :-1].float(), -1)
  targets = ids[0, 1:]
  return logp[torch.arange(len(targets)), targets][len(prompt) - 1:].sum().item()


@pytest.mark.parametrize('reference', ['start', 'base'])
def test_dpo_from_a_loaded_adapter_uses_it_as_reference_like_trl(base_dir, pairs, tmp_path, reference):
  path, rows = pairs
  adapter_dir = str(tmp_path / 'adapter')
  model = peft_adapter(base_dir, adapter_dir, r=4, lora_alpha=8, target_modules='all-linear')
  config = lora_run_config(base_dir, adapter_dir, 4)
  config.model.objective = 'dpo'
  config.data.train_dir = config.data.val_dir = path
  config.trainer.max_steps, config.model.optim.sched.warmup_steps = 1, 0
  beta = config.model_alignment_strategy.dpo.kl_beta
  config.model_alignment_strategy.dpo.reference_model = reference
  train.run(config, str(tmp_path / 'run'))
  record = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line][0]
  policy = np.array([[response_logp(model, r['prompt_input_ids'], r[k]) for k in ('chosen_input_ids', 'rejected_input_ids')]
                     for r in rows])
  if reference == 'start':            # trl keeps a copy of the loaded adapter as its "ref" adapter
    ref = policy
  else:                               # the base: peft's adapters disabled
    with model.disable_adapter():
      ref = np.array([[response_logp(model, r['prompt_input_ids'], r[k]) for k in ('chosen_input_ids', 'rejected_input_ids')]
                      for r in rows])
  h = (policy[:, 0] - policy[:, 1]) - (ref[:, 0] - ref[:, 1])
  expected = float(np.mean(np.logaddexp(0.0, -beta * h)))       # -log sigmoid(beta h), trl's sigmoid loss
  print(f'{reference}: step-1 loss {record["loss"]:.6f}, expected {expected:.6f}')
  assert record['loss'] == pytest.approx(expected, rel=1e-5)
  if reference == 'start':
    assert record['loss'] == pytest.approx(np.log(2), rel=1e-6) and record['rewards/chosen'] == 0.0
  else:
    assert abs(record['loss'] - np.log(2)) > 1e-3
    assert record['rewards/chosen'] == pytest.approx(beta * float(np.mean(policy[:, 0] - ref[:, 0])), rel=1e-4)


def test_dpo_from_a_loaded_adapter_trains_like_trls_dpo_trainer(base_dir, tmp_path):
  """trl's DPOTrainer itself, on the same pairs from the same loaded adapter: equal step-1 loss
  (ln 2: trl's reference is a copy of the loaded adapter), and after one SGD step equal within
  trl's own numerics (its batched log-probs differ from the model's unbatched ones by up to
  ~6e-3 nats on these pairs; flatron's equal those to 1e-7)."""
  trl = pytest.importorskip('trl')
  datasets = pytest.importorskip('datasets')
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  eos, steps, lr, beta = 255, 2, 1.0, 0.1
  vocab = dict({f't{i}': i for i in range(255)}, **{'</s>': eos})
  tok = Tokenizer(models.WordLevel(vocab, unk_token='t0'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(['</s>'])
  adapter_dir = str(tmp_path / 'adapter')
  peft_adapter(base_dir, adapter_dir, r=4, lora_alpha=8, target_modules='all-linear')
  rows = parity.write_pairs(tmp_path / 'raw.jsonl', 8, seed=3, chosen_ids=(1, 255), rejected_ids=(1, 255),
                            prompt_ids=(1, 255))
  words = lambda ids: ' '.join(f't{i}' for i in ids)
  ds = datasets.Dataset.from_list([{'prompt': words(r['prompt_input_ids']), 'chosen': ' ' + words(r['chosen_input_ids']),
                                    'rejected': ' ' + words(r['rejected_input_ids'])} for r in rows])
  args = trl.DPOConfig(output_dir=str(tmp_path / 'trl'), beta=beta, report_to='none', per_device_train_batch_size=8,
                       max_length=None, use_cpu=True, optim='sgd', learning_rate=lr, lr_scheduler_type='constant',
                       max_grad_norm=0.0, weight_decay=0.0, max_steps=steps, logging_steps=1, save_strategy='no')
  trainer = trl.DPOTrainer(model=peft_lib.PeftModel.from_pretrained(hf_model(base_dir).train(), adapter_dir,
                                                                    is_trainable=True),
                           args=args, train_dataset=ds,
                           processing_class=transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='</s>',
                                                                                  pad_token='t0'))
  trainer.train()
  theirs = [h['loss'] for h in trainer.state.log_history if 'loss' in h]
  path = tmp_path / 'pairs.jsonl'                  # the ids trl tokenized, with the EOS it appends
  path.write_text(''.join(json.dumps({'prompt_input_ids': r['prompt_input_ids'],
                                      'chosen_input_ids': r['chosen_input_ids'] + [eos],
                                      'rejected_input_ids': r['rejected_input_ids'] + [eos]}) + '\n' for r in rows))
  config = lora_run_config(base_dir, adapter_dir, 4)
  config.model.objective, config.data.seq_length = 'dpo', 32
  config.data.train_dir = config.data.val_dir = str(path)
  config.model_alignment_strategy.dpo.kl_beta = beta
  config.trainer.max_steps, config.trainer.gradient_clip_val = steps, 0.0
  o = config.model.optim
  o.name, o.lr, o.weight_decay, o.sched.name, o.sched.warmup_steps = 'sgd', lr, 0.0, 'constant', 0
  train.run(config, str(tmp_path / 'run'))
  ours = [json.loads(line)['loss'] for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  print(f'DPOTrainer {theirs}, flatron {ours}')
  assert ours[0] == theirs[0] == pytest.approx(np.log(2), rel=1e-6)
  assert ours[1] == pytest.approx(theirs[1], rel=1e-3) and ours[1] < ours[0]
