"""Activation recompute: gradients bitwise those of no recompute (dropout on, one device and
TP2+SP), the right parts run again in backward, and the bytes each mode keeps per layer,
measured with saved-tensor hooks, equal estimates/activations.py's formula exactly (one device,
TP2 with and without SP, TP4 with SP)."""
import pytest
import torch

from configs import base, llama_tiny
from estimates import activations
from model import attention, layers, param_table, transformer
from parallel import mesh as meshes, remat, tensor
from tests import world

MODES = {                      # name -> (granularity, recompute parts)
    'none': (None, ()),
    'selective': ('selective', ('attention',)),
    'selective_mlp': ('selective', ('attention', 'mlp')),
    'selective_norm_activation': ('selective', ('norm', 'activation')),   # NxD's trn2 70B choice
    'full': ('full', ()),
}
SHAPES = {                     # name -> (seq, micro batch, model keys)
    'llama_gqa': (12, 2, {}),
    'mqa_head_dim': (6, 3, dict(num_kv_heads=1, hidden_size=48, head_dim=16, ffn_hidden_size=40)),
    'gpt_b1': (12, 1, dict(normalization='layernorm', activation='gelu', has_bias=True,
                           position_embedding_type='learned_absolute', num_kv_heads=0)),
    # every layer MoE: 4 experts of width 24, top 2, dropless (with capacity the formula counts
    # the most slots kept: an upper bound), the z-loss on
    'moe': (12, 2, dict(moe=dict(num_experts=4, top_k=2, dropless=True, ffn_hidden_size=24, router_z_loss_coef=0.001))),
    'moe_shared': (12, 2, dict(moe=dict(num_experts=4, top_k=2, dropless=True, ffn_hidden_size=24,
                                        shared_expert_intermediate_size=16))),      # Qwen2-MoE's
    'moe_fixed': (12, 2, dict(moe=dict(num_experts=4, top_k=2, capacity_factor=1.5, ffn_hidden_size=24,
                                       fixed_buffers=True))),   # the traced path's buffers, tokens dropping
}


def config(shape='llama_gqa', mode='none', flash=True, dropout=0.1, tp=1, sp=False):
  s, b, keys = SHAPES[shape]
  c = base.get_config()
  m = c.model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 32, 48
  m.num_attention_heads, m.num_kv_heads, m.vocab_size, m.max_position_embeddings = 4, 2, 100, 32
  keys = dict(keys)
  m.moe.update(keys.pop('moe', {}))
  m.update(keys)
  m.hidden_dropout = m.ffn_dropout = dropout
  m.attention_dropout = 0.0 if flash else dropout    # attention dropout takes the explicit path
  m.fusions.flash_attention = flash
  m.activations_checkpoint_granularity, m.activations_checkpoint_recompute = MODES[mode]
  c.data.seq_length, c.data.micro_batch_size = s, b
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.sequence_parallel = tp, sp
  d.kv_replicator = max(1, tp // param_table.kv_heads(m))
  d.collective_timeout_s = 60
  return c


def loss_and_grads(c, mesh=None):
  mesh = mesh or meshes.Mesh()
  m, b, s = c.model, c.data.micro_batch_size, c.data.seq_length
  params = transformer.init(m, 0, tp=mesh.tp, boxes=tensor.boxes(m, mesh))
  tokens = torch.randint(0, m.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
  batch = {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:], 'loss_mask': torch.ones(b, s),
           'sample_ids': torch.arange(b) + 5}
  ops, recompute = remat.setup(tensor.make_ops(mesh, c.distributed_strategy.sequence_parallel),
                               m.activations_checkpoint_granularity, m.activations_checkpoint_recompute)
  loss = transformer.stage(params, batch, m, ops, dropout_key=(0, 'dropout'), layer_fn=recompute)[0]
  loss.backward()
  return loss.detach(), {name: p.grad for name, p in params.items()}


def mismatched_gradients(mesh=None, sp=False):
  """(flash, mode, name) of every loss or gradient that differs in any bit from no recompute."""
  bad = []
  for flash in (True, False):
    tp = mesh.tp if mesh else 1
    ref_loss, ref = loss_and_grads(config(flash=flash, tp=tp, sp=sp), mesh)
    for mode in ('selective', 'selective_mlp', 'selective_norm_activation', 'full'):
      loss, grads = loss_and_grads(config(mode=mode, flash=flash, tp=tp, sp=sp), mesh)
      bad += [(flash, mode, 'loss')] if not torch.equal(loss, ref_loss) else []
      bad += [(flash, mode, name) for name in ref if not torch.equal(grads[name], ref[name])]
  return bad


def byte_mismatches(cases, tp=1, dtype=torch.float32):
  """(case, measured, formula) wherever the measured bytes per layer differ from the formula."""
  out, meshes_by_replicator = [], {}
  for case in cases:
    c = config(**case, tp=tp)
    rep = c.distributed_strategy.kv_replicator
    if tp > 1 and rep not in meshes_by_replicator:
      meshes_by_replicator[rep] = meshes.init(c)
    mesh = meshes_by_replicator.get(rep)
    measured = activations.measured_bytes_per_layer(c, mesh, dtype)
    formula = activations.activation_bytes_per_layer(c, 4 if dtype == torch.float32 else 2, tp)
    if measured != formula:
      out.append((case, measured, formula))
  return out


def every_case(shape, sp_options=(False,), dropouts=(0.0, 0.1)):
  return [dict(shape=shape, mode=mode, flash=flash, dropout=p, sp=sp)
          for mode in MODES for flash in (True, False) for p in dropouts for sp in sp_options]


def _two_ranks():
  c = config(tp=2, sp=True)
  mesh = meshes.init(c)
  cases = [case for shape in SHAPES for case in every_case(shape, (False, True), (0.1,))]
  return {'gradients': mismatched_gradients(mesh, sp=True), 'bytes': byte_mismatches(cases, tp=2)}


@pytest.fixture(scope='module')
def two_ranks():
  return world.run(_two_ranks, 2)


# --- the policy -----------------------------------------------------------------------


def test_policy_wraps_what_the_config_names():
  assert remat.policy(None) is None and remat.policy('') is None   # default path: nothing added
  assert remat.policy('full') == remat.Recompute(block=remat.checkpointed)
  assert remat.policy('selective') == remat.Recompute(attention=remat.checkpointed)
  assert remat.policy('selective', ('attention', 'mlp')) == remat.Recompute(
      attention=remat.checkpointed, mlp=remat.checkpointed)
  assert remat.policy('selective', ('norm', 'activation')) == remat.Recompute(
      norm=remat.checkpointed, activation=remat.checkpointed)
  with pytest.raises(ValueError, match='unknown parts'):
    remat.policy('selective', ('attn',))
  with pytest.raises(ValueError, match='granularity'):
    remat.policy('layer')


@pytest.mark.parametrize('mode, attention_runs, mlp_runs, norm_runs, activation_runs', [
    ('none', 1, 1, 1, 1), ('selective', 2, 1, 1, 1), ('selective_mlp', 2, 2, 1, 2),
    ('selective_norm_activation', 1, 1, 2, 2), ('full', 2, 2, 2, 2)])
def test_recompute_runs_the_chosen_parts_again_in_backward(mode, attention_runs, mlp_runs, norm_runs,
                                                           activation_runs, monkeypatch):
  calls = {'attention': 0, 'mlp': 0, 'norm': 0, 'activation': 0}

  def counted(name, fn):
    def wrapper(*args):
      calls[name] += 1
      return fn(*args)
    return wrapper

  monkeypatch.setattr(attention, 'core_attention', counted('attention', attention.core_attention))
  monkeypatch.setattr(layers, '_mlp', counted('mlp', layers._mlp))
  monkeypatch.setattr(layers, '_gated', counted('activation', layers._gated))
  monkeypatch.setattr(layers, 'norm', counted('norm', layers.norm))
  loss_and_grads(config(mode=mode))
  # 2 layers; 2 block norms each, and the final norm once
  assert calls == {'attention': 2 * attention_runs, 'mlp': 2 * mlp_runs, 'norm': 4 * norm_runs + 1,
                   'activation': 2 * activation_runs}


# --- gradients ------------------------------------------------------------------------


def test_recompute_gradients_are_bitwise_those_without():
  assert mismatched_gradients() == []


def test_recompute_gradients_are_bitwise_under_tp2_sp(two_ranks):
  assert [r['gradients'] for r in two_ranks] == [[], []]


# --- bytes per layer: measured == formula ----------------------------------------------


@pytest.mark.parametrize('shape', sorted(SHAPES))
def test_measured_bytes_equal_the_formula(shape):
  assert byte_mismatches(every_case(shape)) == []


@pytest.mark.parametrize('shape', ['llama_gqa', 'moe', 'moe_shared', 'moe_fixed'])
def test_measured_bytes_equal_the_formula_in_bf16(shape):
  assert byte_mismatches(every_case(shape), dtype=torch.bfloat16) == []


def test_measured_bytes_equal_the_formula_under_tp2_and_sp(two_ranks):
  assert [r['bytes'] for r in two_ranks] == [[], []]


def _four_ranks():
  """TP4 + SP: the column linears keep a quarter of the sequence (GQA's two KV heads copied to
  two ranks each; the GPT block's layernorms, biases and learned positions)."""
  c = config(tp=4, sp=True)
  meshes.init(c)
  cases = [case for shape in ('llama_gqa', 'gpt_b1', 'moe', 'moe_shared', 'moe_fixed')
           for case in every_case(shape, (True,), (0.1,))]
  return byte_mismatches(cases, tp=4)


def test_measured_bytes_equal_the_formula_under_tp4_and_sp():
  assert world.run(_four_ranks, 4) == [[], [], [], []]


def test_each_mode_keeps_less():
  for flash in (True, False):
    kept = [activations.measured_bytes_per_layer(config(mode=mode, flash=flash))
            for mode in ('none', 'selective', 'selective_mlp', 'full')]
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 4, (flash, kept)
    nxd = activations.measured_bytes_per_layer(config(mode='selective_norm_activation', flash=flash))
    assert kept[-1] < nxd < kept[0], (flash, kept, nxd)


def test_activation_memory_tool_prints_the_table():
  from tools import activation_memory  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  table = activation_memory.cells(c, 'fp32', tp=1)
  assert len(table) == 8 and all(measured == formula for measured, formula in table.values())
  text = activation_memory.render(c, table, 'fp32')
  assert 'all measured == formula' in text and text.count('n/a') == 16    # tp2 not run here
  everything = activation_memory.cells(c, 'bf16', measure=False)
  assert len(everything) == 24 and 'formula only' in activation_memory.render(c, everything, 'bf16')
