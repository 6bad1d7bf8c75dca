"""model/moe.py: Mixtral and Qwen2-MoE against transformers (logits, router logits, loss with
the load-balancing loss, every gradient), exact HF round trips, capacity dropping against a
per-token reference, and the per-sequence aux loss's layout invariance."""
import math
import os
import shutil

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip('transformers')

from configs import base as base_config
from model import hf, layers, moe, moe_checks, moe_dispatch, moe_kernels, router_losses, transformer
from tests import parity
from tests.test_hf import SEQ, TOL, VOCAB, _randomize, random_tokens

BASE_MODEL = base_config.get_config().model
FAMILIES = {
    'mixtral': ('MixtralConfig', 'MixtralForCausalLM',
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    'qwen2_moe': ('Qwen2MoeConfig', 'Qwen2MoeForCausalLM',
                  dict(num_experts=4, num_experts_per_tok=2, intermediate_size=80, moe_intermediate_size=40,
                       shared_expert_intermediate_size=56, norm_topk_prob=False, decoder_sparse_step=2,
                       num_hidden_layers=4)),
}
CASES = {'mixtral': ('mixtral', {}), 'qwen2_moe': ('qwen2_moe', {}),
         'qwen2_moe_norm': ('qwen2_moe', dict(norm_topk_prob=True, decoder_sparse_step=1, num_hidden_layers=2))}


def hf_model(case, seed=0):
  family, extra = CASES[case]
  cls_config, cls_model, kwargs = FAMILIES[family]
  kwargs = {**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, output_router_logits=True,
                   router_aux_loss_coef=0.1), **kwargs, **extra}
  config = getattr(transformers, cls_config)(**kwargs)
  config._attn_implementation = 'eager'
  torch.manual_seed(seed)
  model = getattr(transformers, cls_model)(config).float().eval()
  _randomize(model.named_parameters(), seed)
  return model


def imported(case, tmp_path):
  model = hf_model(case)
  model.save_pretrained(tmp_path, safe_serialization=True)
  m, params = hf.load_hf(str(tmp_path), BASE_MODEL)
  return model, m, params


def _ops():
  return layers.Ops(moe_tally={})


@pytest.mark.parametrize('case', CASES)
def test_logits_router_loss_and_gradients_equal_transformers(case, tmp_path):
  """One sequence (HF's aux loss is over its whole batch; ours per sequence): logits, every
  layer's router logits, the loss with router_aux_loss_coef x aux, and every gradient."""
  model, m, params = imported(case, tmp_path)
  assert m.moe.dropless and m.moe.output_router_logits and m.moe.router_aux_loss_coef == 0.1
  params = {n: t.requires_grad_() for n, t in params.items()}
  sequence = random_tokens(5, b=1)
  batch = dict(tokens=sequence[:, :-1], labels=sequence[:, 1:], loss_mask=torch.ones(1, SEQ))
  ops = _ops()
  routers = []          # each MoE layer's router logits, in order (the stage's, then forward's)
  real_record = router_losses.Collector.record

  def record(self, logits, *rest):
    routers.append(logits.detach())
    return real_record(self, logits, *rest)

  router_losses.Collector.record = record
  try:
    loss, _ = transformer.stage(params, batch, m, ops)
    ours = loss / SEQ
    ours.backward()
    logits = transformer.forward(params, batch['tokens'], m)[..., :VOCAB]
  finally:
    router_losses.Collector.record = real_record
  out = model(sequence[:, :-1], output_router_logits=True)   # the 16 positions we route
  theirs = F.cross_entropy(out.logits[0], sequence[0, 1:]) + 0.1 * out.aux_loss   # HF's loss with labels
  theirs.backward()
  assert (logits - out.logits).abs().max().item() < TOL
  moe_layers = moe.moe_layers(m)
  assert len(routers) == 2 * len(moe_layers) and len(out.router_logits) == len(moe_layers)
  for ours_router, router in zip(routers, out.router_logits):
    assert (ours_router.reshape(router.shape) - router).abs().max().item() < TOL
  assert abs(ours.item() - theirs.item()) < TOL
  assert abs(ops.moe_tally['moe_aux_loss'].item() / SEQ - out.aux_loss.item()) < TOL
  hf_grads = _in_our_names({n: p.grad for n, p in model.named_parameters()})
  assert set(params) == set(hf_grads)
  for name, p in params.items():
    grad = p.grad[:VOCAB] if name in hf.VOCAB_PARAMS else p.grad
    torch.testing.assert_close(grad, hf_grads[name], atol=1e-5, rtol=1e-4, msg=lambda msg: f'{case} {name}: {msg}')


def _in_our_names(hf_tensors):
  """transformers 5's in-memory tensors under our names: gate_up_proj [E, 2f, h] as our gate and
  up stacks."""
  out = {}
  for name, t in hf_tensors.items():
    name = name.removeprefix('model.')
    if name.endswith('.gate_up_proj'):
      base = name.removesuffix('gate_up_proj')
      out[base + 'gate_proj'], out[base + 'up_proj'] = t.chunk(2, dim=1)
    else:
      out[name] = t
  return out


@pytest.mark.parametrize('case', CASES)
def test_a_file_holding_transformers_5s_fused_gate_up_proj_loads_the_same(case, tmp_path):
  model, m, params = imported(case, tmp_path / 'in')
  saved = load_file(tmp_path / 'in' / hf.WEIGHTS_FILE)      # one tensor per expert: the stacks instead
  tensors = {n: t for n, t in saved.items() if '.experts.' not in n}
  tensors.update({n: t.detach().contiguous() for n, t in model.state_dict().items() if '.experts.' in n})
  assert any(n.endswith('gate_up_proj') for n in tensors)
  os.makedirs(tmp_path / 'fused')
  save_file(tensors, tmp_path / 'fused' / hf.WEIGHTS_FILE, metadata={'format': 'pt'})
  shutil.copy(tmp_path / 'in' / 'config.json', tmp_path / 'fused')
  _, again = hf.load_hf(str(tmp_path / 'fused'), BASE_MODEL)
  assert again.keys() == params.keys() and all(torch.equal(params[n], again[n]) for n in params)
  name = next(n for n in params if n.endswith('experts.up_proj'))
  box = (slice(1, 2), slice(2, 5), slice(0, 3))        # one expert, some rows and columns of up
  part = hf.read_boxes(str(tmp_path / 'fused'), m, {name: box})[name]
  assert torch.equal(part, params[name][box])


@pytest.mark.parametrize('case', CASES)
def test_round_trip_is_byte_exact_and_transformers_loads_the_export(case, tmp_path):
  model, m, params = imported(case, tmp_path / 'in')
  hf.save_hf(str(tmp_path / 'out'), m, params)
  before, after = load_file(tmp_path / 'in' / hf.WEIGHTS_FILE), load_file(tmp_path / 'out' / hf.WEIGHTS_FILE)
  assert set(before) == set(after)
  for name in before:
    assert torch.equal(before[name], after[name]), name
  again = getattr(transformers, FAMILIES[CASES[case][0]][1]).from_pretrained(tmp_path / 'out', attn_implementation='eager').float().eval()
  tokens = random_tokens(6)
  with torch.no_grad():
    assert torch.equal(again(tokens).logits, model(tokens).logits)
  m2, params2 = hf.load_hf(str(tmp_path / 'out'), BASE_MODEL)
  assert all(torch.equal(params[n], params2[n]) for n in params)


def _capacity_cfg(cf, dropless=False):
  cfg = base_config.get_config().model
  cfg.moe.update(num_experts=4, top_k=2, capacity_factor=cf, dropless=dropless)
  return cfg


def test_capacity_drops_the_latest_tokens_of_each_sequence_like_a_per_token_reference():
  cfg = _capacity_cfg(0.5)
  g = torch.Generator().manual_seed(1)
  h, f, e, s = 16, 8, 4, 12
  x = torch.randn(3, s, h, generator=g)
  params = {'l.gate.weight': torch.randn(e, h, generator=g), 'l.experts.gate_proj': torch.randn(e, f, h, generator=g),
            'l.experts.up_proj': torch.randn(e, f, h, generator=g),
            'l.experts.down_proj': torch.randn(e, h, f, generator=g)}
  got = moe.mlp(params, 'l', x, cfg, layers.LOCAL_OPS)
  cap = math.ceil(0.5 * s * 2 / e)
  assert moe_dispatch.capacity(cfg, s) == cap == 3
  expected = torch.zeros_like(x)
  for b in range(3):
    used = [0] * e
    for t in range(s):
      p = torch.softmax(x[b, t] @ params['l.gate.weight'].T, -1)
      w, idx = torch.topk(p, 2)
      w = w / w.sum()
      for weight, ex in zip(w, idx.tolist()):
        used[ex] += 1
        if used[ex] > cap:
          continue
        gate, up = params['l.experts.gate_proj'][ex] @ x[b, t], params['l.experts.up_proj'][ex] @ x[b, t]
        expected[b, t] += weight * (params['l.experts.down_proj'][ex] @ (F.silu(gate) * up))
  parity.assert_close_roundoff(got, expected, h + f + 2)    # dot products over h, then f; 2 experts added
  dropless = moe.mlp(params, 'l', x, _capacity_cfg(0.5, dropless=True), layers.LOCAL_OPS)
  assert not torch.allclose(dropless, got)


def test_aux_loss_and_dropping_are_per_sequence_so_micro_batch_splits_agree():
  """The loss sum (with aux and dropping) over one micro batch of 4 equals the sum over 4 of 1."""
  cfg = base_config.get_config().model
  cfg.moe.update(num_experts=4, top_k=2, capacity_factor=0.75, router_z_loss_coef=0.01)
  params = transformer.init(cfg, 0)
  tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(2))
  batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(4, 16))
  whole = transformer.loss_sum(params, batch, cfg)
  parts = sum(transformer.loss_sum(params, {k: v[i:i + 1] for k, v in batch.items()}, cfg) for i in range(4))
  torch.testing.assert_close(whole, parts, atol=1e-5, rtol=1e-6)


def test_checks_name_the_key():
  cfg = base_config.get_config()
  cfg.model.moe.update(num_experts=4, routing_algorithm='sinkhorn', top_k=5, dropout=0.1)
  problems = moe_checks.check(cfg.model)
  assert any('routing_algorithm=sinkhorn' in p for p in problems)
  assert any('top_k=5' in p for p in problems) and any('moe.dropout' in p for p in problems)
  cfg.distributed_strategy.pipeline_model_parallel_size = 2        # the losses cross stages: no refusal
  cfg.distributed_strategy.expert_model_parallel_size = 3
  assert moe_checks.check_layout(cfg.model, cfg.distributed_strategy) == [
      'model.moe.num_experts=4 is not divisible by distributed_strategy.expert_model_parallel_size=3']


@pytest.mark.skipif(not hasattr(torch, '_grouped_mm'), reason='this torch has no _grouped_mm')
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('gpt_oss', [False, True])
def test_the_grouped_gemm_equals_a_matmul_triple_per_expert(dtype, gpt_oss):
  """local_expert_ffn's grouped GEMMs against its per-expert loop, experts without tokens
  included; gpt_oss: with per-expert gate / up biases and the clamped SwiGLU (its sigmoid
  rounds differently in a vector's tail than in its body, so to a few ulps, not bitwise)."""
  from unittest import mock  # pylint: disable=import-outside-toplevel
  g = torch.Generator().manual_seed(0)
  e, h, f, counts = 4, 16, 8, [3, 0, 5, 0]
  shapes = ((8, h), (e, f, h), (e, f, h), (e, h, f)) + (((e, f), (e, f)) if gpt_oss else ())
  tensors = [torch.randn(*shape, generator=g).to(dtype).requires_grad_() for shape in shapes]
  experts = moe_kernels.Experts(*tensors[1:], clamp=(1.702, 0.5) if gpt_oss else ())
  assert moe_kernels._grouped_mm_fits(tensors[0], tensors[1], tensors[3])  # pylint: disable=protected-access
  grad_y = torch.randn(8, h, generator=g).to(dtype)
  grouped = moe_kernels.local_expert_ffn(tensors[0], counts, experts)
  with mock.patch.object(moe_kernels, '_grouped_mm_fits', lambda *args: False):
    loop = moe_kernels.local_expert_ffn(tensors[0], counts, experts)
  if gpt_oss:
    torch.testing.assert_close(grouped, loop, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
  else:
    assert torch.equal(grouped, loop)
  for a, b in zip(torch.autograd.grad(grouped, tensors, grad_y), torch.autograd.grad(loop, tensors, grad_y)):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
