"""Chunked cross-entropy (model/chunked_ce.py) equals the unchunked head + loss: per-token
losses and every gradient (head input, head weight, the tied embedding table), for chunk
sizes that do and do not divide the token count, with masked tokens, packed rows, 16-bit
recipes, the preference objectives, and at TP 2 with and without SP."""
import types

import pytest
import torch
import torch.nn.functional as F

import numpy as np

import train
from configs import base, validate
from model import chunked_ce, layers, objectives, param_table, transformer
from parallel import tensor
from tests import parity, world

CHUNKS = (1, 5, 7, 24, 1000)   # 24 tokens: 5 and 7 leave a short last chunk; 24 and 1000 are one chunk
# Chunked and unchunked heads add in other orders (parity.roundoff): the logits' dot products over
# the hidden size, the log-softmax over the vocabulary, dW's and the loss's sums over the tokens.
OP_TERMS = 16 + 50 + 24        # _op_case: hidden 16, vocabulary 50, 24 tokens
MODEL_TERMS = 32 + 100 + 24    # tiny(): hidden 32, vocabulary 100; packed_batch(): 24 tokens


def tiny(chunk=0, **overrides):
  m = base.get_config().model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 32, 48
  m.num_attention_heads, m.num_kv_heads, m.vocab_size = 4, 2, 100   # padded to 128: padded rows excluded
  m.max_position_embeddings = 32
  m.fusions.chunked_cross_entropy = chunk
  m.update(overrides)
  return m


def packed_batch(b=2, s=12, vocab=100, seed=0):
  """Two documents per row (segment_ids) and a masked prompt at the start of each."""
  g = torch.Generator().manual_seed(seed)
  toks = torch.randint(0, vocab, (b, s + 1), generator=g)
  loss_mask = torch.ones(b, s)
  loss_mask[:, :3] = 0
  loss_mask[1, 7:9] = 0
  segments = torch.cat([torch.zeros(b, 5, dtype=torch.long), torch.ones(b, s - 5, dtype=torch.long)], 1)
  return {'tokens': toks[:, :-1], 'labels': toks[:, 1:], 'loss_mask': loss_mask, 'segment_ids': segments,
          'sample_ids': torch.arange(b)}


def loss_and_grads(m, params, batch, ops=layers.LOCAL_OPS):
  params = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
  loss = transformer.loss_sum(params, batch, m, ops)
  loss.backward()
  return loss.detach(), {n: p.grad for n, p in params.items()}


def assert_same(ours, ref):
  (loss, grads), (ref_loss, ref_grads) = ours, ref
  parity.assert_close_roundoff(loss, ref_loss, MODEL_TERMS)
  assert grads.keys() == ref_grads.keys()
  for name in ref_grads:
    parity.assert_close_roundoff(grads[name], ref_grads[name], MODEL_TERMS, msg=name)


# --- the op itself ---------------------------------------------------------------------------


def _op_case(dtype=torch.float32, seed=0):
  g = torch.Generator().manual_seed(seed)
  x = torch.randn(2, 12, 16, generator=g).to(dtype)
  w = (torch.randn(64, 16, generator=g) * 0.5).to(dtype)
  labels = torch.randint(0, 50, (2, 12), generator=g)
  upstream = torch.randn(2, 12, generator=g) * (torch.rand(2, 12, generator=g) > 0.3)   # masked tokens: 0
  return x, w, labels, upstream


def _op(x, w, labels, upstream, chunk):
  x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
  if chunk:
    losses = chunked_ce.chunked_cross_entropy(x, w, labels, 50, layers.LOCAL_OPS, chunk)
  else:
    losses = layers.LOCAL_OPS.cross_entropy(F.linear(x, w), labels, 50)
  (losses * upstream).sum().backward()
  return losses.detach(), x.grad, w.grad


@pytest.mark.parametrize('chunk', CHUNKS)
def test_losses_and_gradients_equal_the_unchunked_op(chunk):
  case = _op_case()
  ref = _op(*case, chunk=0)
  ours = _op(*case, chunk=chunk)
  for a, b in zip(ours, ref):
    parity.assert_close_roundoff(a, b, OP_TERMS)
  assert ours[2][50:].abs().max() == 0          # padded vocab rows get no gradient


@pytest.mark.parametrize('recipe', ['autocast', 'bf16'])
def test_16_bit_recipes_compute_in_their_dtype_and_add_no_rounding(recipe):
  """Losses and dL/dx as the unchunked op gives them in bf16; dL/dW (summed over chunks in
  fp32) within bf16 rounding of the fp32 gradient, like the unchunked one."""
  x, w, labels, upstream = _op_case()
  exact = _op(x, w, labels, upstream, chunk=0)
  if recipe == 'bf16':
    x, w = x.bfloat16(), w.bfloat16()
  with torch.autocast('cpu', dtype=torch.bfloat16, enabled=recipe == 'autocast'):
    ref = _op(x, w, labels, upstream, chunk=0)
    ours = _op(x, w, labels, upstream, chunk=5)
  assert ours[1].dtype == ref[1].dtype == x.dtype and ours[2].dtype == ref[2].dtype == w.dtype
  torch.testing.assert_close(ours[0], ref[0], rtol=1e-2, atol=1e-2)
  torch.testing.assert_close(ours[1], ref[1], rtol=1e-2, atol=1e-2)
  for grad_w in (ours[2], ref[2]):
    torch.testing.assert_close(grad_w.float(), exact[2], rtol=2 ** -7, atol=2 ** -7 * exact[2].abs().max().item())


def test_token_losses_take_logits_or_a_head_input():
  x, w, labels, _ = _op_case()
  cfg = types.SimpleNamespace(vocab_size=50)
  plain = chunked_ce.token_losses(F.linear(x, w), labels, cfg, layers.LOCAL_OPS)
  chunked = chunked_ce.token_losses(chunked_ce.HeadInput(x, w, 5), labels, cfg, layers.LOCAL_OPS)
  parity.assert_close_roundoff(chunked, plain, OP_TERMS)
  with pytest.raises(ValueError, match='model.fusions.chunked_cross_entropy'):
    chunked_ce.chunked_cross_entropy(x, w, labels, 50, layers.LOCAL_OPS, 0)


# --- the model: masked, packed, tied ---------------------------------------------------------


@pytest.mark.parametrize('tied', [False, True])
@pytest.mark.parametrize('chunk', CHUNKS)
def test_model_loss_and_every_gradient_equal_the_unchunked_head(chunk, tied):
  """loss_sum (the summed-loss contract) and every parameter's gradient; tied, the head's
  gradient reaches the embedding table (the same leaf) next to the lookup's."""
  params = transformer.init(tiny(share_embeddings_and_output_weights=tied), 3)
  batch = packed_batch()
  ref = loss_and_grads(tiny(0, share_embeddings_and_output_weights=tied), params, batch)
  ours = loss_and_grads(tiny(chunk, share_embeddings_and_output_weights=tied), params, batch)
  assert_same(ours, ref)
  assert ('lm_head.weight' in ours[1]) != tied


def test_logits_for_generation_and_eval_stay_whole():
  m = tiny(5)
  params = transformer.init(m, 3)
  batch = packed_batch()
  logits = transformer.forward(params, batch['tokens'], m, segment_ids_bs=batch['segment_ids'])
  assert logits.shape == (2, 12, param_table.padded_vocab_size(m, 1))


@pytest.mark.parametrize('objective', ['dpo', 'ipo', 'orpo_token', 'orpo_pair'])
def test_preference_objectives_chunk_their_per_token_log_probs(objective):
  """DPO / IPO / ORPO read per-token log-probs through the same op: their loss, metrics and
  gradients are the unchunked ones."""
  c = base.get_config()
  name, _, variant = objective.partition('_')
  c.model.objective = 'orpo' if name == 'orpo' else 'dpo'
  c.model_alignment_strategy.dpo.loss_type = 'ipo' if name == 'ipo' else 'sigmoid'
  c.model_alignment_strategy.orpo.nll_reduction = variant or 'pair'
  objective_fn = objectives.for_config(c)
  x, w, labels, _ = _op_case()
  chosen = torch.zeros(2, 12)
  chosen[:, 3:7] = 1
  rejected = torch.zeros(2, 12)
  rejected[:, 8:11] = 1
  batch = {'labels': labels, 'chosen_mask': chosen, 'rejected_mask': rejected,
           'ref_logps': torch.tensor([[-40.0, -45.0], [-42.0, -41.0]]),
           'global_count': torch.tensor(2.0), 'global_extra': torch.tensor(8.0)}
  cfg = types.SimpleNamespace(vocab_size=50)

  def run(chunk):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    head = chunked_ce.HeadInput(xx, ww, chunk) if chunk else F.linear(xx, ww)
    loss, metrics = objective_fn.loss(head, batch, cfg, layers.LOCAL_OPS)
    loss.backward()
    return loss.detach(), metrics, xx.grad, ww.grad

  ref, ours = run(0), run(5)
  parity.assert_close_roundoff(ours[0], ref[0], OP_TERMS)
  assert ours[1].keys() == ref[1].keys()
  for key in ref[1]:
    torch.testing.assert_close(ours[1][key], ref[1][key], rtol=1e-6, atol=1e-5, msg=key)
  parity.assert_close_roundoff(ours[2], ref[2], OP_TERMS)
  parity.assert_close_roundoff(ours[3], ref[3], OP_TERMS)


# --- TP 2, with and without SP -----------------------------------------------------------------


def _tp_rank(sp, tied):
  """Chunked and unchunked on the same TP layout, and each rank's share of the unchunked
  single-device gradients: max abs differences (loss, then every gradient)."""
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes  # pylint: disable=import-outside-toplevel
  if not dist.is_initialized():            # the world's first case (world.in_turn runs several)
    dist.init_process_group('gloo')
  mesh = meshes.Mesh(tp=2, rank=dist.get_rank())
  ops = tensor.make_ops(types.SimpleNamespace(tp_group=dist.group.WORLD, tp=2, cp=1), sp)
  out = {}
  for chunk in (0, 5, 7):
    m = tiny(chunk, share_embeddings_and_output_weights=tied)
    boxes = tensor.boxes(m, mesh)
    params = transformer.init(m, 3, tp=2, boxes=boxes)
    out[chunk] = loss_and_grads(m, params, packed_batch(), ops)
  single_m = tiny(0, share_embeddings_and_output_weights=tied)
  single = loss_and_grads(single_m, transformer.init(single_m, 3, tp=2), packed_batch())
  errors = []
  for chunk in (5, 7):
    (loss, grads), (ref_loss, ref_grads) = out[chunk], out[0]
    errors.append(('loss', chunk, float((loss - ref_loss).abs())))
    errors += [(name, chunk, float((grads[name] - ref_grads[name]).abs().max())) for name in ref_grads]
    errors.append(('single-device loss', chunk, float((loss - single[0]).abs())))
    for name in ('embed_tokens.weight', 'lm_head.weight'):
      if name in grads:
        errors.append((f'single-device {name}', chunk, float((grads[name] - single[1][name][boxes[name]]).abs().max())))
  return errors


def test_tp2_chunked_equals_unchunked_and_one_device():
  """TP, TP + SP, TP + SP with tied tables: one after another in one world."""
  cases = [(False, False), (True, False), (True, True)]
  for rank in world.run(world.in_turn, 2, [(_tp_rank, case) for case in cases]):
    for (sp, tied), errors in zip(cases, rank):
      worst = max(errors, key=lambda e: e[2])
      assert worst[2] < 1e-5, (f'sp={sp} tied={tied}', worst)


def _train_chunked(workdir, layout, chunk):
  config = parity.parity_config(**layout)
  config.model.fusions.chunked_cross_entropy = chunk
  _, params = train.run(config, workdir)
  return parity.rank_result(config, workdir, params)


def test_training_tp2_sp_tied_chunked_is_training_on_one_device_unchunked(tmp_path, tmp_path_factory):
  """train.py end to end (10 steps, clipping active): TP 2 + SP, tied tables, 7-token chunks
  of 32-token micro batches, against the single-device unchunked run at the layout tests' bounds."""
  layout = {'tp': 2, 'sp': True, 'tied': True}
  ref_losses, ref_norms, ref_params = parity.reference(tmp_path_factory, tied=True)
  results = world.run(_train_chunked, 2, str(tmp_path), layout, 7)
  losses, norms, _ = results[0]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
  params = parity.assemble(results, parity.parity_config(**layout).model)
  for name in ref_params:
    np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-5, err_msg=name)


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize('value', [-1, True])
def test_bad_chunk_sizes_are_reported_naming_the_key(value):
  c = base.get_config()
  c.model.fusions.chunked_cross_entropy = value
  problems = validate.check(c)
  assert any('model.fusions.chunked_cross_entropy' in p for p in problems), problems
  with pytest.raises(TypeError, match='chunked_cross_entropy'):    # the config's type check, at parse time
    c.model.fusions.chunked_cross_entropy = 1.5
