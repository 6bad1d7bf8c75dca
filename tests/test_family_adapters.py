"""LoRA on Qwen3, Qwen3-MoE, OLMo 2, SmolLM3, Phi-3, Llama 4, gpt-oss and DeepSeek-V3 (the HF tests' small
models, every feature of the family on) with peft as the oracle: our adapter, saved as a peft directory, loads
with PeftModel.from_pretrained and gives our logits, and peft's own adapter loads here and gives
its logits. Phi-3's fused qkv_proj / gate_up_proj share one A (model/lora_fused.py): its gradient
equals peft's, one dropout mask serves the module, tp2 + SP trains like one device, what peft
cannot hold is refused, and DPO from a peft adapter (Phi-3, gpt-oss, DeepSeek-V3) gives trl's loss
on peft's logits."""
import json
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import train
from configs import validate
from model import adapters, hf, layers, lora, lora_targets, param_table, transformer
from tests import parity
from tests.test_adapters import peft_adapter, response_logp
from tests.test_hf import BASE_MODEL, VOCAB, random_tokens
from tests.test_hf_families import FAMILIES, TOL, hf_model

transformers = pytest.importorskip('transformers')
peft_lib = pytest.importorskip('peft')

SETTINGS = dict(r=4, lora_alpha=8, target_modules='all-linear')     # peft's LoraConfig
# peft on transformers 5 reads a MoE model's MLP targets as its experts' (`target_parameters`, by
# the v4 modules' names) and adapts no dense MLP: both ways, Qwen3-MoE's and Llama 4's adapters are
# on attention
TARGETS = {'qwen3_moe': ['q_proj', 'k_proj', 'v_proj', 'o_proj'], 'llama4_text': ['q_proj', 'k_proj', 'v_proj', 'o_proj']}


def randomized(named, seed, scale=0.1):
  """Every LoRA factor of (name, tensor) pairs random and non-zero (B starts at zero otherwise)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in named:
      if 'lora_' in name:
        p.copy_(torch.randn(p.shape, generator=g) * scale)


def base_of(family, tmp_path, model=None):
  """(HF directory, our model section with LoRA off, our base params) of the family's small model
  (or of `model`, a transformers model)."""
  path = str(tmp_path / 'base')
  (model or hf_model(family)).save_pretrained(path)
  cfg, params = hf.load_hf(path, BASE_MODEL)
  return path, cfg, params


def reloaded(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation='eager').float().eval()


def with_lora(cfg, targets='all-linear'):
  """Model section `cfg` with LoRA r 4, alpha 8 on `targets` (peft's LoraConfig.target_modules)."""
  cfg = cfg.copy_and_resolve_references()
  targets = (targets,) if isinstance(targets, str) else tuple(targets)
  cfg.peft.update(dict(lora_rank=4, lora_alpha=8.0, target_modules=targets))
  return cfg


def logits(params, cfg, tokens):
  with torch.no_grad():
    return transformer.forward(params, tokens, cfg)[..., :VOCAB]


def both_ways(family, base_dir, cfg0, base, targets, tmp_path):
  """Our adapter on `targets` loads in peft with our logits, peft's loads here with its logits, and
  the merged weights load in transformers with them too; the files hold the same tensors and
  targets. Returns (our model section with LoRA, our base params, the adapter file's tensors)."""
  tokens = random_tokens(5, s=24)
  cfg = with_lora(cfg0, targets)
  adapted = lora.trainable(cfg, param_table.param_specs(cfg))
  params = dict(base, **transformer.init(cfg, 3, boxes={n: None for n in adapted}))
  randomized(params.items(), 1)
  adapters.save_peft(str(tmp_path / 'ours'), cfg, params, base_model_name_or_path=base_dir)      # ours -> peft
  with torch.no_grad():
    loaded = peft_lib.PeftModel.from_pretrained(reloaded(base_dir), str(tmp_path / 'ours')).eval()(tokens).logits
  ours = logits(params, cfg, tokens)
  to_peft = (loaded - ours).abs().max().item()
  settings = dict(SETTINGS, target_modules=targets)
  theirs_model = peft_lib.get_peft_model(reloaded(base_dir), peft_lib.LoraConfig(**settings))    # peft -> ours
  randomized(theirs_model.named_parameters(), 2)
  theirs_model.eval().save_pretrained(str(tmp_path / 'theirs'))
  cfg2, params2 = adapters.load_peft(str(tmp_path / 'theirs'), cfg0, base)
  with torch.no_grad():
    theirs = theirs_model(tokens).logits
  from_peft = (logits(params2, cfg2, tokens) - theirs).abs().max().item()
  hf.save_hf(str(tmp_path / 'merged'), cfg2, lora.merged(params2, cfg2))          # W + scaling B A, as HF files
  with torch.no_grad():
    merged = (reloaded(str(tmp_path / 'merged'))(tokens).logits - theirs).abs().max().item()
  print(f'{family}: ours -> peft {to_peft:.2e}, peft -> ours {from_peft:.2e}, merged {merged:.2e}')
  assert to_peft < TOL and from_peft < TOL and merged < TOL
  assert (logits(base, cfg0, tokens) - ours).abs().max().item() > 1e-2          # the adapters matter
  # the same tensors under the same names, and target_modules as peft writes them
  ours_file, theirs_file = (load_file(tmp_path / d / adapters.WEIGHTS_FILE) for d in ('ours', 'theirs'))
  assert {k: v.shape for k, v in ours_file.items()} == {k: v.shape for k, v in theirs_file.items()}
  written = {d: json.loads((tmp_path / d / adapters.CONFIG_FILE).read_text()) for d in ('ours', 'theirs')}
  # (peft writes all-linear as module paths, as suffixes from 20 modules on: the same modules)
  theirs_targets = {t.rsplit('.', 1)[-1] for t in written['theirs']['target_modules']}
  assert sorted(written['ours']['target_modules']) == sorted(theirs_targets)
  again = adapters.load_peft(str(tmp_path / 'ours'), cfg0, base)[1]                 # and back, exactly
  assert all(torch.equal(again[n], params[n]) for n in params if lora.is_adapter(n))
  return ours_file


@pytest.mark.parametrize('family', FAMILIES)
def test_adapters_go_both_ways_with_peft_logits(family, tmp_path):
  base_dir, cfg0, base = base_of(family, tmp_path)
  ours_file = both_ways(family, base_dir, cfg0, base, TARGETS.get(family, 'all-linear'), tmp_path)
  if family == 'qwen3_moe':                 # adapters on its MLPs: peft cannot hold them, either way
    trained = with_lora(cfg0)
    adapted = lora_targets.plan(trained, base)
    assert any('.mlp.' in n for n in adapted) and not any('experts' in n for n in adapted)
    with pytest.raises(ValueError, match='peft on transformers 5 reads the target_modules gate_proj'):
      adapters.save_peft(str(tmp_path / 'mlp'), trained, dict(base, **transformer.init(trained, 3)))
    peft_lib.get_peft_model(reloaded(base_dir), peft_lib.LoraConfig(**SETTINGS)).save_pretrained(str(tmp_path / 'all'))
    with pytest.raises(ValueError, match='not supported here: target_parameters'):
      adapters.load_peft(str(tmp_path / 'all'), cfg0, base)
  if family == 'phi3':
    assert sorted({k.split('.')[-3] for k in ours_file}) == ['down_proj', 'gate_up_proj', 'o_proj', 'qkv_proj']


# gpt-oss's biased q/k/v/o (its sinks beside them), and latent attention's own projections: the
# down projections whole on every TP rank, their factors too (model/lora.py FACTOR_LAYOUTS)
OWN_ATTENTION = {'gpt_oss': ['q_proj', 'k_proj', 'v_proj', 'o_proj'],
                 'deepseek_v3': ['q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj']}


@pytest.mark.parametrize('family', sorted(OWN_ATTENTION))
def test_gpt_oss_and_latent_attention_adapters_go_both_ways_with_peft(family, tmp_path):
  from tests import test_hf_gpt_oss, test_mla  # pylint: disable=import-outside-toplevel
  model = {'gpt_oss': test_hf_gpt_oss, 'deepseek_v3': test_mla}[family].hf_model()
  base_dir, cfg0, base = base_of(family, tmp_path, model)
  ours_file = both_ways(family, base_dir, cfg0, base, OWN_ATTENTION[family], tmp_path)
  assert sorted({k.split('.')[-3] for k in ours_file}) == sorted(OWN_ATTENTION[family])


def test_phi3_shared_a_gets_peft_gradient(tmp_path):
  """The shared A's gradient sums its q, k and v (gate and up) uses, as peft's one A; the Bs'
  rows are peft's B's."""
  base_dir, cfg0, base = base_of('phi3', tmp_path)
  model = peft_lib.get_peft_model(reloaded(base_dir), peft_lib.LoraConfig(**SETTINGS))
  randomized(model.named_parameters(), 4)
  model.save_pretrained(str(tmp_path / 'theirs'))
  cfg, params = adapters.load_peft(str(tmp_path / 'theirs'), cfg0, base)
  for name, p in params.items():
    p.requires_grad_(lora.is_adapter(name))
  ids = random_tokens(6, s=17)
  batch = {'tokens': ids[:, :-1], 'labels': ids[:, 1:], 'loss_mask': torch.ones(ids[:, 1:].shape)}
  ours = transformer.loss_sum(params, batch, cfg) / batch['loss_mask'].sum()
  ours.backward()
  theirs = F.cross_entropy(model.train()(ids[:, :-1]).logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
  theirs.backward()
  adapters.save_peft(str(tmp_path / 'grads'), cfg, {n: p.grad for n, p in params.items() if lora.is_adapter(n)})
  grads = load_file(tmp_path / 'grads' / adapters.WEIGHTS_FILE)           # ours, as peft's tensors
  named = dict(model.named_parameters())
  worst = max((grads[k] - named[k.replace('.weight', '.default.weight')].grad).abs().max().item() for k in grads)
  print(f'phi3 adapter gradients vs peft: worst {worst:.2e}, loss {abs(ours.item() - theirs.item()):.2e}')
  assert worst < 1e-5 and abs(ours.item() - theirs.item()) < 1e-5
  assert 'layers.0.self_attn.qkv_proj.lora_A.weight' in params
  assert 'layers.0.self_attn.q_proj.lora_A.weight' not in params


def test_phi3_fused_module_draws_one_dropout_mask():
  """q and k read one mask on x: with k's B the first rows of q's, k's update is those rows of q's."""
  cfg = parity.parity_config(family='phi3', lora=4, lora_dropout=0.5).model
  params = transformer.init(cfg, 0)
  q, k = 'layers.0.self_attn.q_proj', 'layers.0.self_attn.k_proj'
  randomized(((n, params[n]) for n in (q + '.lora_B.weight', k + '.lora_B.weight')), 5)
  with torch.no_grad():
    params[k + '.lora_B.weight'].copy_(params[q + '.lora_B.weight'][:params[k + '.lora_B.weight'].shape[0]])
  x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(0))

  def update(name, drop_key):
    out = layers.linear(params, name, x, cfg, layers.LOCAL_OPS, 'column', drop_key, torch.arange(2))
    return (out - F.linear(x, params[name + '.weight'])).detach()

  dq, dk = update(q, (0, 'layer', 0)), update(k, (0, 'layer', 0))
  torch.testing.assert_close(dk, dq[..., :dk.shape[-1]], rtol=0, atol=1e-6)
  assert (dq - update(q, None)).abs().max() > 1e-2                        # the dropout acted


@pytest.mark.parametrize('peft,message', [
    (dict(target_modules=('q_proj', 'o_proj')), "'q_proj' is inside one of Phi-3's fused modules (qkv_proj)"),
    (dict(rank_pattern=(('q_proj', 8),)), 'gives model.layers.0.self_attn.q_proj 8, but its fused Phi-3 module '
                                          'model.layers.0.self_attn.qkv_proj 4'),
    (dict(alpha_pattern=(('qkv_proj', 2.0), ('up_proj', 3.0))), 'model.layers.0.mlp.up_proj 3.0, but its fused '
                                                                 'Phi-3 module model.layers.0.mlp.gate_up_proj 8.0'),
])
def test_what_peft_cannot_hold_on_phi3_is_refused_with_both_values(peft, message):
  c = parity.parity_config(family='phi3', lora=4)
  c.model_alignment_strategy.peft.update(peft)
  assert any(message in p for p in validate.check(c))
  with pytest.raises(ValueError, match='fused'):
    param_table.param_specs(c.model)
  c = parity.parity_config(family='qwen3', lora=4)           # elsewhere qkv_proj is NxD's: q, k and v
  c.model_alignment_strategy.peft.update(dict(peft, target_modules=('qkv_proj',)))
  assert not any('fused' in p for p in validate.check(c))
  names = param_table.param_specs(c.model)
  assert all(f'layers.0.self_attn.{p}.lora_A.weight' in names for p in ('q_proj', 'k_proj', 'v_proj'))


def test_phi3_lora_at_tp2_sp_with_dropout_trains_like_one_device(tmp_path, tmp_path_factory):
  """The shared A, whole on each rank, sums its three uses there and its partial gradient over TP;
  q's B split by heads, k's and v's by KV heads; one keyed mask per fused module at every layout."""
  layout = {'tp': 2, 'sp': True, 'family': 'phi3', 'lora': 4, 'lora_dropout': 0.1}
  trained = parity.check_layouts({'phi3_lora_tp2_sp_dropout': (2, layout)}, tmp_path, tmp_path_factory)
  params = trained['phi3_lora_tp2_sp_dropout']
  config = parity.parity_config(**layout)
  start = transformer.init(config.model, config.seed)['layers.1.mlp.gate_up_proj.lora_A.weight'].detach().numpy()
  assert np.abs(params['layers.1.mlp.gate_up_proj.lora_A.weight'] - start).max() > 1e-3


def test_latent_attention_lora_at_tp2_sp_with_dropout_trains_like_one_device(tmp_path, tmp_path_factory):
  """DeepSeek-V3 with adapters on every linear LoRA takes (all-linear): the whole down projections'
  factors whole on each rank, their gradients from the rank's heads summed over TP, q_b / kv_b's
  B split by heads."""
  layout = {'tp': 2, 'sp': True, 'family': 'deepseek_v3', 'lora': 4, 'lora_dropout': 0.1}
  trained = parity.check_layouts({'deepseek_v3_lora_tp2_sp_dropout': (2, layout)}, tmp_path, tmp_path_factory)
  config = parity.parity_config(**layout)
  start = transformer.init(config.model, config.seed)
  for name in ('layers.1.self_attn.q_a_proj.lora_A.weight', 'layers.1.self_attn.kv_a_proj_with_mqa.lora_B.weight'):
    assert np.abs(trained['deepseek_v3_lora_tp2_sp_dropout'][name] - start[name].detach().numpy()).max() > 1e-3, name


@pytest.mark.parametrize('family', ['phi3', 'gpt_oss', 'deepseek_v3'])
def test_dpo_from_a_peft_adapter_gives_trls_loss(family, tmp_path):
  """Two DPO steps from a peft-made adapter (reference: the base, peft's adapters disabled):
  step 1's loss is trl's sigmoid loss on peft's log-probs. Phi-3's fused modules, gpt-oss's
  sinks and biased attention, DeepSeek-V3's latent attention (MoE's auxiliary losses off: trl's
  formula has none)."""
  c = parity.parity_config(family=family, lora=4, objective='dpo')
  c.model.moe.update(output_router_logits=False, router_z_loss_coef=0.0)
  base_dir, adapter_dir = str(tmp_path / 'base'), str(tmp_path / 'adapter')
  hf.save_hf(base_dir, c.model, transformer.init(parity.parity_config(family=family).model, 7))
  model = peft_adapter(base_dir, adapter_dir, **dict(SETTINGS, target_modules=OWN_ATTENTION.get(family, 'all-linear')))
  rows = parity.write_pairs(tmp_path / 'pairs.jsonl', 8, seed=3, chosen_ids=(0, 256), rejected_ids=(0, 256),
                            prompt_ids=(0, 256))
  c.exp_manager.init_from = base_dir
  p = c.model_alignment_strategy.peft
  p.lora_alpha = p.lora_dropout = p.target_modules = None
  p.update(dict(load_lora_from_ckpt=True, lora_save_dir=adapter_dir))
  c.data.train_dir = c.data.val_dir = str(tmp_path / 'pairs.jsonl')
  c.trainer.max_steps, c.model.optim.sched.warmup_steps = 2, 0
  c.model_alignment_strategy.dpo.reference_model = 'base'
  train.run(c, str(tmp_path / 'run'))
  records = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl') if '"loss"' in line]
  sides = ('chosen_input_ids', 'rejected_input_ids')
  logp = lambda m: np.array([[response_logp(m, r['prompt_input_ids'], r[k]) for k in sides] for r in rows])
  policy = logp(model)
  with model.disable_adapter():
    ref = logp(model)
  h = (policy[:, 0] - policy[:, 1]) - (ref[:, 0] - ref[:, 1])
  beta = c.model_alignment_strategy.dpo.kl_beta
  expected = float(np.mean(np.logaddexp(0.0, -beta * h)))         # -log sigmoid(beta h)
  print(f'{family} DPO: losses {[r["loss"] for r in records]}, trl\'s formula at step 1 {expected:.6f}')
  assert records[0]['loss'] == pytest.approx(expected, rel=1e-5) and abs(expected - np.log(2)) > 1e-4
  assert len(records) == 2 and records[1]['loss'] < records[0]['loss']
