"""checkpoint/nxd_params.py (and nxd_write.py's split, its inverse): NxD Training's model
shards -> flatron's parameters, at tp 2 / 4, pp 1 / 2, kv_replicator 1 / 2, trn1 and trn2 head
orders, Mixtral at tp 2 x ep 2; the logits equal transformers' on the source model. Where each
rank's rows sit is pinned against NxD's modules as read in NxD Core 2.26 (qkv_linear.py,
parallel_state.py's kv-shared groups, layers.py's strided ColumnParallelLinear, ExpertMLPs)."""
import json
import os
import shutil

import pytest
import torch

from checkpoint import nxd_files, nxd_params, nxd_write
from model import hf, transformer
from tests.test_hf import BASE_MODEL, VOCAB, family_model, random_tokens

transformers = pytest.importorskip('transformers')

LAYOUTS = {   # name: (tp, pp, kv_replicator, hw)
    'tp2': (2, 1, 1, 'trn1'),
    'tp4_pp2_rep2_trn1': (4, 2, 2, 'trn1'),
    'tp4_rep2_trn2': (4, 1, 2, 'trn2'),
}


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
  """A GQA Llama (8 query heads, 2 KV heads, 3 layers) and flatron's import of it."""
  model = family_model('llama', dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3))
  path = tmp_path_factory.mktemp('hf')
  model.save_pretrained(path, safe_serialization=True)
  cfg, params = hf.load_hf(str(path), BASE_MODEL)
  return model, cfg, params


def _round_trip(tmp_path, cfg, params, tp, pp=1, ep=1, rep=1, hw='trn1'):
  shards = nxd_write.split(params, cfg, tp, pp, ep, rep, hw)
  tag = nxd_write.write_tag(str(tmp_path), shards, 'hf_llama', 12, 96)
  return shards, nxd_params.merge(nxd_files.open_tag(tag), cfg, hw)


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_shards_merge_back_to_the_model_and_its_logits(llama, tmp_path, layout):
  model, cfg, params = llama
  tp, pp, rep, hw = LAYOUTS[layout]
  _, merged = _round_trip(tmp_path, cfg, params, tp, pp, rep=rep, hw=hw)
  again = nxd_params.merge(nxd_files.open_tag(str(tmp_path)), cfg)          # the order found from the replicas
  assert all(torch.equal(again[n], merged[n]) for n in merged)
  assert merged.keys() == params.keys() and all(torch.equal(merged[n], params[n]) for n in params)
  tokens = random_tokens(3)
  with torch.no_grad():
    ours = transformer.forward(merged, tokens, cfg)[..., :VOCAB]
    theirs = model(tokens).logits
  assert (ours - theirs).abs().max().item() < 1e-5


def test_the_wrong_hardware_order_is_refused_naming_the_right_one(llama, tmp_path):
  _, cfg, params = llama
  tag = nxd_write.write_tag(str(tmp_path), nxd_write.split(params, cfg, 4, kv_replicator=2, hw='trn2'), 'm', 1, 8)
  with pytest.raises(nxd_files.NxDCheckpointError, match='pass hw=trn2'):
    nxd_params.merge(nxd_files.open_tag(tag), cfg, 'trn1')


def test_tp4_with_kv_replicator_missing_its_last_tp_ranks_is_refused_naming_them(llama, tmp_path):
  _, cfg, params = llama
  shards = nxd_write.split(params, cfg, 4, 2, kv_replicator=2)
  tag = nxd_write.write_tag(str(tmp_path), {k: v for k, v in shards.items() if k[1] < 2}, 'm', 1, 8)
  with pytest.raises(nxd_files.NxDCheckpointError, match=r'holds tp ranks 0\.\.1 but .*: the files of tp ranks 2\.\.3 are '
                                                         r'missing \(model/dp_rank_00_tp_rank_02_pp_rank_00\.pt, .* \.\.\.\)'):
    nxd_params.merge(nxd_files.open_tag(tag), cfg)


def test_a_config_of_another_model_is_refused_with_both_shapes(llama, tmp_path):
  _, cfg, params = llama
  tag = nxd_write.write_tag(str(tmp_path), nxd_write.split(params, cfg, 2), 'm', 1, 8)
  other = cfg.copy_and_resolve_references()
  other.ffn_hidden_size = 128
  with pytest.raises(nxd_files.NxDCheckpointError, match=r'gate_proj.weight is \(96, 64\) in the checkpoint, \(128, 64\)'):
    nxd_params.merge(nxd_files.open_tag(tag), other)


def test_mixtral_at_tp2_ep2_merges_to_transformers_logits(tmp_path):
  from tests.test_moe import hf_model  # pylint: disable=import-outside-toplevel
  model = hf_model('mixtral')
  model.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  cfg, params = hf.load_hf(str(tmp_path / 'hf'), BASE_MODEL)
  shards, merged = _round_trip(tmp_path / 'nxd', cfg, params, 2, ep=2)
  up = shards[(1, 1, 0)]['model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight']
  assert up.shape == (2, 64, 48)               # [E / ep, h, 2 f / tp]: gate | up halves, input-major
  assert torch.equal(up[0, :, 24:], params['layers.0.mlp.experts.up_proj'][2, 24:48].T)
  assert 'model.layers.0.mlp.router.linear_router.weight' not in shards[(1, 0, 0)]   # ep rank 0's only
  assert all(torch.equal(merged[n], params[n]) for n in params)
  tokens = random_tokens(4, b=1)
  with torch.no_grad():
    assert (transformer.forward(merged, tokens, cfg)[..., :VOCAB] - model(tokens).logits).abs().max().item() < 1e-5


# --- against NxD Core's own code (tests/fixtures/nxd_ckpt/nxd_core/README.md) -----------------

NXD_CORE = os.path.join(os.path.dirname(__file__), 'fixtures', 'nxd_ckpt', 'nxd_core')


def _converter_case(tmp_path, case):
  """(tag, model config, flatron params of the source HF model) of one of NxD's converter outputs."""
  src = os.path.join(NXD_CORE, case)
  tag = tmp_path / 'm--step=2-consumed_samples=4.0.ckpt'
  shutil.copytree(os.path.join(src, 'model'), tag / 'model')
  (tag / 'done').write_text('1')
  hf_config = json.load(open(os.path.join(src, 'config.json')))
  hf_config.update(architectures=['LlamaForCausalLM'], tie_word_embeddings=False)
  cfg = hf.config_from_hf(hf_config, BASE_MODEL)
  full = torch.load(os.path.join(src, 'full.pt'), weights_only=True)
  params = {n.removeprefix('model.'): t for n, t in full.items()}
  return str(tag), cfg, params


def test_nxd_s_converter_output_at_tp4_trn1_merges_to_its_source_and_nxd_write_writes_the_same(tmp_path):
  tag, cfg, params = _converter_case(tmp_path, 'converter_tp4_m2_trn1')
  merged = nxd_params.merge(nxd_files.open_tag(tag), cfg)
  assert all(torch.equal(merged[n][:cfg.vocab_size], params[n]) for n in params)
  ours = nxd_write.split(merged, cfg, 4, kv_replicator=2, hw='trn1')
  for r in range(4):
    theirs = torch.load(os.path.join(tag, 'model', f'dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt'), weights_only=True)
    assert ours[(0, r, 0)].keys() == theirs.keys() and all(torch.equal(ours[(0, r, 0)][k], theirs[k]) for k in theirs)


def test_nxd_s_trn2_converter_output_is_read_as_the_model_it_computes(tmp_path):
  """NxD's converter writes trn2 at kv_replicator 2 with the queries in order but trn1's tiled
  K/V (rank r: query head r, KV head r % 2), so NxD computes query head 1 with KV head 1: the
  merge groups each rank's queries with the KV copy it holds, the function that checkpoint has."""
  tag, cfg, params = _converter_case(tmp_path, 'converter_tp4_m2_trn2')
  merged = nxd_params.merge(nxd_files.open_tag(tag), cfg)
  d, order = 8, [0, 2, 1, 3]                      # the query heads grouped by the KV head beside them
  q = params['layers.0.self_attn.q_proj.weight'].view(4, d, -1)[order].reshape(32, -1)
  o = params['layers.0.self_attn.o_proj.weight'].view(-1, 4, d)[:, order].reshape(-1, 32)
  assert torch.equal(merged['layers.0.self_attn.q_proj.weight'], q) and torch.equal(merged['layers.0.self_attn.o_proj.weight'], o)
  assert torch.equal(merged['layers.0.self_attn.k_proj.weight'], params['layers.0.self_attn.k_proj.weight'])
  with pytest.raises(nxd_files.NxDCheckpointError, match="in trn1's order: pass hw=trn1"):
    nxd_params.merge(nxd_files.open_tag(tag), cfg, 'trn2')


def test_a_trn2_random_init_with_kv_replicator_is_refused(tmp_path):
  """NxD's GQAQKVColumnParallelLinear initialized on trn2 with kv_size_multiplier 2 repeats K/V
  rows, not heads: no rank pair holds one KV head, so no HF model has these weights."""
  tag, cfg, _ = _converter_case(tmp_path, 'converter_tp4_m2_trn1')
  for r in range(4):
    path = os.path.join(tag, 'model', f'dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt')
    state = torch.load(path, weights_only=True)
    state['model.layers.0.self_attn.qkv_proj.weight_qkv'] = torch.load(
        os.path.join(NXD_CORE, 'gqa_tp4_m2_trn2', f'rank_{r}.pt'), weights_only=True)['weight_qkv']
    torch.save(state, path)
  with pytest.raises(nxd_files.NxDCheckpointError, match="neither trn1's nor trn2's replica groups"):
    nxd_params.merge(nxd_files.open_tag(tag), cfg)


@pytest.mark.parametrize('kv_heads', [4, 2])
def test_megatron_style_shards_merge_per_head(tmp_path, kv_heads):
  """NxD Training's Megatron modules (models/megatron/transformer.py) at tp 2: query_key_value
  [heads, 3, d] per rank (or query + key_value [kv heads, 2, d]), dense_h_to_4h [gate_r; up_r],
  the vocabulary padded past the tokenizer's (to a multiple of 8 x tp)."""
  model = family_model('llama', dict(num_key_value_heads=kv_heads, num_hidden_layers=2))
  model.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  cfg, params = hf.load_hf(str(tmp_path / 'hf'), BASE_MODEL)
  tp, d, h, f = 2, 16, 64, 96
  shards = {}
  for r in range(tp):
    s = {}
    for i in range(2):
      p, n = f'layers.{i}.', f'language_model.encoder.layers.{i}.'
      q, k, v = (params[p + f'self_attn.{x}_proj.weight'].chunk(tp)[r] for x in 'qkv')
      if kv_heads == 4:
        s[n + 'self_attention.query_key_value.weight'] = torch.stack(
            [q.view(-1, d, h), k.view(-1, d, h), v.view(-1, d, h)], 1).reshape(-1, h)
      else:
        s[n + 'self_attention.query.weight'] = q
        s[n + 'self_attention.key_value.weight'] = torch.stack([k.view(-1, d, h), v.view(-1, d, h)], 1).reshape(-1, h)
      s[n + 'self_attention.dense.weight'] = params[p + 'self_attn.o_proj.weight'].chunk(tp, 1)[r]
      s[n + 'mlp.dense_h_to_4h.weight'] = torch.cat([params[p + 'mlp.gate_proj.weight'].chunk(tp)[r],
                                                     params[p + 'mlp.up_proj.weight'].chunk(tp)[r]])
      s[n + 'mlp.dense_4h_to_h.weight'] = params[p + 'mlp.down_proj.weight'].chunk(tp, 1)[r]
      s[n + 'input_layernorm.weight'] = params[p + 'input_layernorm.weight']
      s[n + 'post_attention_layernorm.weight'] = params[p + 'post_attention_layernorm.weight']
    padded = torch.cat([params['embed_tokens.weight'][:VOCAB], torch.randn(304 - VOCAB, h)])   # 300 -> 304
    s['language_model.embedding.word_embeddings.weight'] = padded.chunk(tp)[r]
    s['language_model.output_layer.weight'] = torch.cat([params['lm_head.weight'][:VOCAB],
                                                         torch.randn(304 - VOCAB, h)]).chunk(tp)[r]
    s['language_model.encoder.final_layernorm.weight'] = params['norm.weight']
    shards[(0, r, 0)] = s
  assert f == cfg.ffn_hidden_size
  merged = nxd_params.merge(nxd_files.open_tag(nxd_write.write_tag(str(tmp_path / 'nxd'), shards, 'megatron_llama', 3, 24)),
                            cfg)
  assert all(torch.equal(merged[n], params[n]) for n in params)
