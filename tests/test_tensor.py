"""TP/SP boxes and ops; every layout trains exactly like one device (gloo, fp32, dropout off)."""
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import param_init, param_table, transformer
from parallel import comm, mesh as meshes, tensor
from tests import parity, world

LAYOUTS = {
    'dp2': (2, {}),
    'tp2': (2, {'tp': 2}),
    'tp2_sp': (2, {'tp': 2, 'sp': True}),
    'tp4_kv2_replicated': (4, {'tp': 4, 'kv_replicator': 2}),
    'dp2_tp2_sp': (4, {'tp': 2, 'sp': True}),
    'tp2_sp_dropout': (2, {'tp': 2, 'sp': True, 'dropout': 0.1}),   # keyed masks: same as one device
    'tp2_sp_qwen2_bias_llama3_rope': (2, {'tp': 2, 'sp': True, 'qkv_bias': True, 'rope_llama3': True}),
    'tp2_gemma3': (2, {'tp': 2, 'family': 'gemma3'}),   # q/k norms' grads summed over TP without SP too
}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_layouts_train_like_one_device(world_size, tmp_path, tmp_path_factory):
  """The layouts of one world size, one after another in one spawned world."""
  parity.check_layouts(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


# --- unit tests of the ops (in-process where a group of one suffices, else 2 ranks) -------


def test_boxes_tile_every_parameter_exactly_once():
  cfg = parity.parity_config().model
  cfg.num_kv_heads = 2
  for tp, rep in ((1, 1), (2, 1), (4, 2)):
    specs = param_table.param_specs(cfg, tp)
    for name, spec in specs.items():
      cover = np.zeros(spec.shape, dtype=int)
      for t in range(tp):
        cover[tensor.tp_box(spec, tp, t, rep)] += 1
      copies = tp if tensor.is_tp_replicated(spec.layout) else rep if tensor.is_kv(spec.layout) else 1
      assert (cover == copies).all(), (name, tp)


def test_sharded_init_equals_the_slice_of_the_single_device_init():
  cfg = parity.parity_config().model
  full = transformer.init(cfg, 5, tp=4)
  for t in range(4):
    mesh = meshes.Mesh(tp=4, rank=t, kv_replicator=2)
    local = transformer.init(cfg, 5, tp=4, boxes=tensor.boxes(cfg, mesh))
    for name, box in tensor.boxes(cfg, mesh).items():
      assert torch.equal(local[name], full[name][box]), name
  assert torch.equal(full['embed_tokens.weight'][cfg.vocab_size:], torch.zeros(512 - 256, 32))
  moe_cfg = parity.parity_config(moe=4, ep=2, tp=2).model       # experts split over tp 2 and ep 2
  full = transformer.init(moe_cfg, 5, tp=2)
  for r in range(4):
    mesh = meshes.Mesh(tp=2, dp=2, ep=2, rank=r)
    boxes = tensor.boxes(moe_cfg, mesh)
    local = transformer.init(moe_cfg, 5, tp=2, boxes=boxes)
    assert all(torch.equal(local[name], full[name][box]) for name, box in boxes.items()), r


def test_a_rank_draws_only_its_experts_rows():
  """Mixtral-8x7B's up_proj stack [8, 14336, 4096] at tp 32: a rank's box is 1/32 of each expert;
  it draws 64-row blocks of its own rows, never a block of 64 whole experts (15 GiB)."""
  spec = param_table.ParamSpec((8, 14336, 4096), 'normal', 0.02)
  box = (slice(0, 8), slice(448, 896), slice(0, 4096))
  drawn = []
  real = param_init.rng.normal

  def recording(shape, *args, **kwargs):
    drawn.append(shape)
    return real((1,) + tuple(shape[1:]), *args, **kwargs).expand(shape)   # cheap stand-in values

  with mock.patch.object(param_init.rng, 'normal', recording):
    out = param_init.init_box(spec, 0, 'layers.0.mlp.experts.up_proj', box)
  assert out.shape == (8, 448, 4096) and drawn and all(shape == (64, 4096) for shape in drawn)
  assert len(drawn) == 8 * 448 // 64


def _vocab_ops(seed):
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  dist.init_process_group('gloo')
  group, r = dist.group.WORLD, dist.get_rank()
  g = torch.Generator().manual_seed(seed)
  vocab, padded, h = 10, 12, 4
  logits_full = torch.randn(2, 3, padded, generator=g)
  labels = torch.randint(0, vocab, (2, 3), generator=g)
  table = torch.randn(padded, h, generator=g)
  ids = torch.randint(0, vocab, (2, 3), generator=g)
  local_logits = logits_full.chunk(2, -1)[r].clone().requires_grad_()
  loss = tensor.vocab_parallel_cross_entropy(local_logits, labels, vocab, group)
  loss.sum().backward()
  full = logits_full.clone().requires_grad_()
  ref = F.cross_entropy(full[..., :vocab].flatten(0, 1), labels.flatten(), reduction='none').view(2, 3)
  ref.sum().backward()
  local_table = table.chunk(2)[r].clone().requires_grad_()
  emb = tensor.vocab_parallel_embedding(ids, local_table, group)
  (emb * torch.arange(h)).sum().backward()
  full_table = table.clone().requires_grad_()
  ref_emb = F.embedding(ids, full_table)
  (ref_emb * torch.arange(h)).sum().backward()
  return [float((loss - ref).abs().max()), float((local_logits.grad - full.grad.chunk(2, -1)[r]).abs().max()),
          float((emb - ref_emb).abs().max()),
          float((local_table.grad - full_table.grad.chunk(2)[r]).abs().max())]


def test_vocab_parallel_cross_entropy_and_embedding_match_the_dense_ops():
  for errors in world.run(_vocab_ops, 2, 0):
    assert max(errors) < 1e-6, errors


def _tp_reductions():
  """{(reduce dtype, sp): (forward, backward)} bitwise checks of the TP reductions on 4 ranks
  in bf16: a row-parallel output (all-reduce, or SP's reduce-scatter) and the gradient entering
  a TP region (all-reduce, or the SP gather's reduce-scatter), each against the partials summed
  in fp32 and rounded once."""
  import types  # pylint: disable=import-outside-toplevel
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  dist.init_process_group('gloo')
  r, n = dist.get_rank(), dist.get_world_size()
  parts = [torch.randn(1, 8 * n, 1, generator=torch.Generator().manual_seed(k)).bfloat16() for k in range(n)]
  summed = sum(p.float() for p in parts).bfloat16()
  out = {}
  for reduce_dtype in (torch.float32, None):
    for sp in (False, True):
      ops = tensor.make_ops(types.SimpleNamespace(tp_group=dist.group.WORLD, tp=n, cp=1), sp, reduce_dtype)
      expected = summed.chunk(n, 1)[r] if sp else summed
      forward = torch.equal(ops.row_linear(parts[r], torch.ones(1, 1, dtype=torch.bfloat16)), expected)
      local = torch.zeros(1, 8 if sp else 8 * n, 1, dtype=torch.bfloat16, requires_grad=True)
      ops.full_input(local).backward(parts[r])
      out[(str(reduce_dtype), sp)] = (forward, torch.equal(local.grad, expected))
  return out


def test_parallel_layers_reduce_dtype_fp32_sums_bf16_partials_in_fp32():
  results = world.run(_tp_reductions, 4)
  for ranks in results:
    assert ranks[('torch.float32', False)] == ranks[('torch.float32', True)] == (True, True)
  # the check can fail: summed in bf16 (the default), the same partials round differently
  assert results[0][('None', False)] == results[0][('None', True)] == (False, False)


def test_each_parameter_declares_its_layout_and_none_is_guessed():
  m = parity.parity_config(qkv_bias=True).model
  m.position_embedding_type, m.qk_norm, m.sandwich_norm = 'learned_absolute', True, True
  layouts = tensor.layouts(m)
  assert tensor.is_tp_replicated(layouts['layers.0.input_layernorm.weight'])
  assert not tensor.is_tp_replicated(layouts['layers.0.self_attn.o_proj.weight'])
  assert not tensor.is_tp_replicated(layouts['layers.0.self_attn.q_proj.bias'])
  assert tensor.is_kv(layouts['layers.0.self_attn.v_proj.bias'])
  assert not tensor.is_tp_replicated(layouts['lm_head.weight'])
  assert tensor.is_sequence_parallel_replicated(layouts['norm.weight'])
  assert not tensor.is_sequence_parallel_replicated(layouts['embed_positions.weight'])
  # per-head norms: replicated, each rank's gradient covers its heads only
  for name in ('layers.0.self_attn.q_norm.weight', 'layers.0.self_attn.k_norm.weight'):
    assert tensor.is_tp_replicated(layouts[name]) and tensor.is_tp_partial(layouts[name])
    assert not tensor.is_sequence_parallel_replicated(layouts[name])      # summed once, not twice under SP
  assert not tensor.is_tp_partial(layouts['layers.0.pre_feedforward_layernorm.weight'])
  # a parameter a fork adds without a layout is refused by name, not replicated by default
  specs = param_table.param_specs(m)
  specs['layers.0.self_attn.gate_proj.weight'] = param_table.ParamSpec((4, 4), 'normal', 0.02)
  with pytest.raises(ValueError, match=r'layers\.0\.self_attn\.gate_proj\.weight.*declare one of vocab, column'):
    param_table.check_layouts(specs)
  assert comm.group_size(None) == 1
