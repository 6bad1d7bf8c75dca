"""The functional transformer: init purity, features, masking, dropout keys, recompute; against
transformers' models (built by tests/test_hf.py): the loss and every gradient, sliding windows
inside packed documents, and KV-cache decoding under a window."""
import copy

import pytest
import torch

from configs import base
from model import hf, objectives, param_table, transformer
from parallel import remat
from tests import parity


def tiny(**overrides):
  m = base.get_config().model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 32, 48
  m.num_attention_heads, m.num_kv_heads, m.vocab_size = 4, 2, 100
  m.max_position_embeddings = 32
  m.update(overrides)
  return m


def batch(b=2, s=12, vocab=100, seed=0):
  g = torch.Generator().manual_seed(seed)
  toks = torch.randint(0, vocab, (b, s + 1), generator=g)
  return {'tokens': toks[:, :-1], 'labels': toks[:, 1:], 'loss_mask': torch.ones(b, s),
          'sample_ids': torch.arange(b)}


def test_init_is_a_pure_function_of_seed_and_name():
  m = tiny()
  a, b, c = transformer.init(m, 1), transformer.init(m, 1), transformer.init(m, 2)
  assert all(torch.equal(a[k], b[k]) for k in a)
  assert not torch.equal(a['layers.0.self_attn.q_proj.weight'], c['layers.0.self_attn.q_proj.weight'])
  # Adding a layer does not change the existing layers' values: init is keyed by name.
  deeper = transformer.init(tiny(num_layers=3), 1)
  assert torch.equal(a['layers.1.mlp.up_proj.weight'], deeper['layers.1.mlp.up_proj.weight'])


def test_megatron_init_statistics():
  m = tiny(hidden_size=256, ffn_hidden_size=512, num_layers=8, vocab_size=128)
  p = transformer.init(m, 0)
  assert p['layers.0.self_attn.q_proj.weight'].std().item() == pytest.approx(0.02, rel=0.05)
  assert p['layers.0.mlp.down_proj.weight'].std().item() == pytest.approx(0.02 / 4, rel=0.05)
  assert torch.equal(p['norm.weight'], torch.ones(256))


def test_param_shapes_and_vocab_padding():
  m = tiny()
  specs = param_table.param_specs(m)
  assert specs['embed_tokens.weight'].shape == (128, 32)
  assert specs['layers.0.self_attn.k_proj.weight'].shape == (16, 32)          # 2 kv heads x d 8
  assert param_table.padded_vocab_size(m, tp=4) == 512
  assert param_table.count_params(m) == sum(
      torch.Size(s.shape).numel() for s in specs.values()) - 2 * 28 * 32      # padding not counted


def logits(m, params, b):
  return transformer.forward(params, b['tokens'], m, position_ids_bs=b.get('position_ids'),
                             segment_ids_bs=b.get('segment_ids'))


def test_causal_future_tokens_do_not_change_past_logits():
  m = tiny()
  p, b = transformer.init(m, 0), batch()
  out = logits(m, p, b)
  b2 = dict(b, tokens=b['tokens'].clone())
  b2['tokens'][:, 6:] = 7
  out2 = logits(m, p, b2)
  torch.testing.assert_close(out[:, :6], out2[:, :6])
  assert not torch.allclose(out[:, 6:], out2[:, 6:])


@pytest.mark.parametrize('overrides', [
    {}, {'num_kv_heads': 0}, {'apply_query_key_layer_scaling': True},
    {'position_embedding_type': 'learned_absolute', 'normalization': 'layernorm',
     'activation': 'gelu', 'has_bias': True, 'share_embeddings_and_output_weights': True},
])
def test_sdpa_and_explicit_attention_agree(overrides):
  m = tiny(**overrides)
  p, b = transformer.init(m, 0), batch()
  fused = logits(m, p, b)
  m.fusions.flash_attention = False
  torch.testing.assert_close(logits(m, p, b), fused, atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa, mha = tiny(num_kv_heads=2), tiny(num_kv_heads=4)
  p = transformer.init(gqa, 0)
  q = dict(p)
  for i in range(2):
    for name in ('k_proj', 'v_proj'):
      w = p[f'layers.{i}.self_attn.{name}.weight']                      # [2 heads * 8, 32]
      q[f'layers.{i}.self_attn.{name}.weight'] = w.view(2, 8, 32).repeat_interleave(2, 0).reshape(32, 32)
  b = batch()
  torch.testing.assert_close(logits(gqa, p, b), logits(mha, q, b), atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_other_dims_position_free():
  m = tiny(rotary_percentage=0.5)
  p, b = transformer.init(m, 0), batch()
  full = tiny()
  assert not torch.allclose(logits(m, p, b), logits(full, p, b))


def test_segment_mask_and_reset_positions_isolate_documents():
  m = tiny()
  p = transformer.init(m, 0)
  b = batch(b=1, s=12)
  segments = torch.tensor([[0] * 5 + [1] * 7])
  positions = torch.tensor([list(range(5)) + list(range(7))])
  packed = logits(m, p, dict(b, segment_ids=segments, position_ids=positions))
  alone = logits(m, p, {'tokens': b['tokens'][:, 5:]})
  torch.testing.assert_close(packed[:, 5:], alone, atol=1e-5, rtol=1e-5)
  m.fusions.flash_attention = False
  torch.testing.assert_close(logits(m, p, dict(b, segment_ids=segments, position_ids=positions)),
                             packed, atol=1e-5, rtol=1e-5)


def loss_and_grads(m, p, batches, n_tokens, **kw):
  for t in p.values():
    t.grad = None
  total = 0.0
  for b in batches:
    loss = transformer.loss_sum(p, b, m, **kw) / n_tokens
    loss.backward()
    total += loss.item()
  return total, {k: t.grad.clone() for k, t in p.items()}


def split(b, n):
  return [{k: v.chunk(n)[i] for k, v in b.items()} for i in range(n)]


def test_dropout_is_keyed_by_sample_so_micro_batch_split_does_not_matter():
  m = tiny(hidden_dropout=0.1, attention_dropout=0.1, ffn_dropout=0.1)
  m.fusions.flash_attention = False
  p, b = transformer.init(m, 0), batch(b=4)
  key = (0, 'dropout')
  whole, g_whole = loss_and_grads(m, p, [b], 48, dropout_key=key)
  halves, g_halves = loss_and_grads(m, p, split(b, 2), 48, dropout_key=key)
  # one micro batch or two: other orders of the head's dot products (hidden 32), the log-softmax
  # (vocabulary 100) and the loss's sum over 48 tokens (parity.roundoff)
  assert whole == pytest.approx(halves, rel=parity.roundoff(32 + 100 + 48))
  for k in g_whole:
    torch.testing.assert_close(g_whole[k], g_halves[k], atol=1e-6, rtol=1e-5)
  other, _ = loss_and_grads(m, p, [dict(b, sample_ids=b['sample_ids'] + 100)], 48, dropout_key=key)
  no_drop, _ = loss_and_grads(m, p, [b], 48)
  assert len({round(whole, 6), round(other, 6), round(no_drop, 6)}) == 3


def test_full_recompute_gives_identical_gradients():
  m = tiny(hidden_dropout=0.1)
  p, b = transformer.init(m, 0), batch()
  ref, g_ref = loss_and_grads(m, p, [b], 24, dropout_key=(0, 'd'))
  got, g_got = loss_and_grads(m, p, [b], 24, dropout_key=(0, 'd'), layer_fn=remat.policy('full'))
  assert ref == got
  for k in g_ref:
    assert torch.equal(g_ref[k], g_got[k]), k


def test_padded_vocab_rows_get_no_probability():
  m = tiny()
  p, b = transformer.init(m, 0), batch()
  with torch.no_grad():
    p['lm_head.weight'][100:] = 50.0          # huge logits on padded ids must not matter
  loss = transformer.loss_sum(p, b, m) / 24
  with torch.no_grad():
    p['lm_head.weight'][100:] = 0.0
  torch.testing.assert_close(loss, transformer.loss_sum(p, b, m) / 24)


@pytest.mark.parametrize('overrides', [{}, {'position_embedding_type': 'learned_absolute'},
                                       {'fusions': {'flash_attention': False}}])
def test_decoding_with_a_kv_cache_gives_the_full_forward_logits(overrides):
  m = tiny(**overrides)
  params = transformer.init(m, 3)
  tokens = batch(b=2, s=10)['tokens']
  full = logits(m, params, {'tokens': tokens})
  prefill, cache = transformer.decode(params, tokens[:, :6], m)
  steps = [prefill]
  for t in range(6, 10):
    out, cache = transformer.decode(params, tokens[:, t:t + 1], m, cache)
    steps.append(out)
  two, _ = transformer.decode(params, tokens[:, 8:], m, transformer.decode(params, tokens[:, :8], m)[1])
  torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
  torch.testing.assert_close(two, full[:, 8:], atol=1e-5, rtol=1e-5)
  assert cache.length == 10 and cache.keys[0].shape == (2, 2, 10, 8)


# --- against transformers: tests/test_hf.py's models, imported inside each test so that without
# transformers only these tests skip ------------------------------------------------------------


GRAD_CASES = ('llama_rope_llama3', 'mistral_window5', 'qwen2_window5', 'gemma3')


@pytest.mark.parametrize('case', GRAD_CASES)
def test_loss_and_gradients_equal_transformers(case, tmp_path):
  """Our masked next-token loss (transformer.loss_sum / token count) and every parameter's
  gradient equal transformers' `model(tokens, labels=...).loss` and its gradients."""
  from tests.test_hf import SEQ, TOL, VOCAB, imported, random_tokens  # pylint: disable=import-outside-toplevel
  model, m, params = imported(case, tmp_path)
  params = {name: t.requires_grad_() for name, t in params.items()}
  sequence = random_tokens(3)
  loss_mask = torch.ones(2, SEQ)
  loss_mask[0, :5] = 0                       # a prompt: its next tokens are not trained on
  batch = dict(tokens=sequence[:, :-1], labels=sequence[:, 1:], loss_mask=loss_mask)
  ours = transformer.loss_sum(params, batch, m) / objectives.NEXT_TOKEN.count(batch)
  ours.backward()
  # HF shifts itself: label j is predicted at position j - 1, so loss_mask[:, j - 1] == 0 is label -100.
  ignored = torch.cat([torch.zeros(2, 1, dtype=torch.bool), loss_mask == 0], dim=1)
  theirs = model(sequence, labels=sequence.masked_fill(ignored, -100)).loss
  theirs.backward()
  loss_err = abs(ours.item() - theirs.item())

  hf_params = dict(model.named_parameters())   # a tied head is not listed: its grad is the embedding's
  assert {'model.' + n if n != 'lm_head.weight' else n for n in params} == set(hf_params)
  worst_abs, worst_rel, worst_name = 0.0, 0.0, ''
  for name, p in params.items():
    grad = p.grad
    if name in hf.VOCAB_PARAMS:
      assert not grad[VOCAB:].any(), f'{name}: padded vocab rows got a gradient'
      grad = grad[:VOCAB]
    expected = hf_params[name if name == 'lm_head.weight' else 'model.' + name].grad
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=lambda msg: f'{case} {name}: {msg}')
    err = (grad - expected).abs().max().item()
    if err > worst_abs:
      worst_abs, worst_rel, worst_name = err, err / expected.abs().max().item(), name
  print(f'{case}: |loss error| = {loss_err:.2e}; worst |grad error| = {worst_abs:.2e} '
        f'({worst_rel:.1e} of that grad\'s max) in {worst_name}')
  assert loss_err < TOL


def test_sliding_window_inside_packed_documents(tmp_path):
  """Mistral, window 4, two documents (9 and 8 tokens) packed in one row, positions restarting
  at the second: each document's logits equal HF's for that document alone."""
  from tests.test_hf import BASE_MODEL, TOL, VOCAB, family_model, random_tokens  # pylint: disable=import-outside-toplevel
  model = family_model('mistral', dict(sliding_window=4, num_key_value_heads=2))
  model.save_pretrained(tmp_path)
  m, params = hf.load_hf(str(tmp_path), BASE_MODEL)
  assert m.sliding_window == 4
  lengths = (9, 8)
  tokens = random_tokens(4, b=1, s=sum(lengths))
  segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
  position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
  with torch.no_grad():
    ours = transformer.forward(params, tokens, m, position_ids_bs=position_ids,
                               segment_ids_bs=segment_ids)[0, :, :VOCAB]
    theirs = torch.cat([model(doc[None]).logits[0] for doc in tokens[0].split(lengths)])
    err = (ours - theirs).abs().max().item()
    print(f'packed mistral window 4: max |logit error| = {err:.2e}')
    assert err < TOL
    # both the window and the document boundary change these logits
    unsegmented = transformer.forward(params, tokens, m, position_ids_bs=position_ids)[0, :, :VOCAB]
    assert (unsegmented[lengths[0]:] - theirs[lengths[0]:]).abs().max() > 1e-3
    no_window = copy.deepcopy(m)
    no_window.sliding_window = 0
    full = transformer.forward(params, tokens, no_window, position_ids_bs=position_ids,
                               segment_ids_bs=segment_ids)[0, :, :VOCAB]
    for doc_full, doc_theirs in zip(full.split(lengths), theirs.split(lengths)):
      assert (doc_full - doc_theirs).abs().max() > 1e-3


@pytest.mark.parametrize('flash', [True, False], ids=['sdpa', 'explicit'])
@pytest.mark.parametrize('case', ['mistral_window5', 'gemma3'])
def test_decode_with_kv_cache_under_sliding_window(case, flash, tmp_path):
  """A 6-token prompt, then 8 tokens one at a time through the KV cache: the logits equal one
  forward over all 14 (and transformers'), with the window (5) shorter than the context."""
  from tests.test_hf import TOL, VOCAB, imported, random_tokens  # pylint: disable=import-outside-toplevel
  model, m, params = imported(case, tmp_path)
  m.fusions.flash_attention = flash
  tokens = random_tokens(5, s=14)
  with torch.no_grad():
    full = transformer.forward(params, tokens, m)
    logits, cache = transformer.decode(params, tokens[:, :6], m)
    steps = [logits]
    for i in range(6, 14):
      logits, cache = transformer.decode(params, tokens[:, i:i + 1], m, cache)
      steps.append(logits)
    theirs = model(tokens).logits
  assert cache.length == 14
  err = (torch.cat(steps, dim=1) - full).abs().max().item()
  print(f'{case} ({"sdpa" if flash else "explicit"}): decode vs forward max |logit error| = {err:.2e}')
  assert err < TOL
  assert (full[..., :VOCAB] - theirs).abs().max().item() < TOL
