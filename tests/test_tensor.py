"""TP/SP boxes and ops; every layout trains exactly like one device (gloo, fp32, dropout off)."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from configs import llama_tiny
from model import transformer
from parallel import comm, mesh as meshes, tensor
from tests import world

STEPS = 10


def parity_config(tp=1, sp=False, kv_replicator=1, dropout=0.0):
  c = llama_tiny.get_config('test')
  c.trainer.max_steps = STEPS
  c.trainer.val_check_interval = 0
  c.trainer.gradient_clip_val = 0.3          # below the early grad norms: clipping is active
  c.exp_manager.create_tensorboard_logger = False
  c.data.global_batch_size, c.data.micro_batch_size = 8, 2    # accumulation at every DP degree
  c.model.hidden_dropout = c.model.attention_dropout = c.model.ffn_dropout = dropout
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.sequence_parallel, d.kv_replicator = tp, sp, kv_replicator
  d.collective_timeout_s = 120
  return c


def _train(workdir, **layout):
  """On every rank: train, then return losses and this rank's parameter boxes."""
  config = parity_config(**layout)
  _, params = train.run(config, workdir)
  mesh = meshes.Mesh(tp=config.distributed_strategy.tensor_model_parallel_size,
                     rank=int(os.environ.get('RANK', 0)), kv_replicator=config.distributed_strategy.kv_replicator)
  boxes = tensor.boxes(config.model, mesh)
  losses, norms = None, None
  if mesh.rank == 0:
    records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
    losses = [r['loss'] for r in records if 'loss' in r]
    norms = [r['grad_norm'] for r in records if 'loss' in r]
  return losses, norms, {n: (boxes[n], p.detach().numpy()) for n, p in params.items()}


def assemble(rank_results, model_cfg):
  """Global parameters (unpadded vocab) from every rank's boxes."""
  pieces = {}
  for _, _, boxes in rank_results:
    for name, (box, value) in boxes.items():
      pieces.setdefault(name, []).append((box, value))
  out = {}
  for name, parts in pieces.items():
    shape = [max(box[i].stop for box, _ in parts) for i in range(parts[0][1].ndim)]
    array = np.zeros(shape, dtype=np.float32)
    written = {}
    for box, value in parts:
      key = tuple((sl.start, sl.stop) for sl in box)
      if key in written:                    # replicas (TP-replicated, KV copies) must agree exactly
        np.testing.assert_array_equal(value, written[key], err_msg=f'replicas of {name} diverged')
      written[key] = value
      array[box] = value
    out[name] = array[:model_cfg.vocab_size] if name in tensor.VOCAB_TABLES else array
  return out


_REFERENCES = {}


def reference(dropout, tmp_path_factory):
  """The single-device run (once per dropout setting)."""
  if dropout not in _REFERENCES:
    results = [_train(str(tmp_path_factory.mktemp('single')), dropout=dropout)]
    _REFERENCES[dropout] = results[0][0], results[0][1], assemble(results, parity_config().model)
  return _REFERENCES[dropout]


LAYOUTS = {
    'dp2': (2, {}),
    'tp2': (2, {'tp': 2}),
    'tp2_sp': (2, {'tp': 2, 'sp': True}),
    'tp4_kv2_replicated': (4, {'tp': 4, 'kv_replicator': 2}),
    'dp2_tp2_sp': (4, {'tp': 2, 'sp': True}),
    'tp2_sp_dropout': (2, {'tp': 2, 'sp': True, 'dropout': 0.1}),   # keyed masks: same as one device
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_layout_trains_like_one_device(layout, tmp_path, tmp_path_factory):
  world_size, kwargs = LAYOUTS[layout]
  ref_losses, ref_norms, ref_params = reference(kwargs.get('dropout', 0.0), tmp_path_factory)
  results = world.run(_train_layout, world_size, str(tmp_path), kwargs)
  losses, norms, _ = results[0]
  assert ref_norms[0] > 0.3                                  # clipping was active
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
  params = assemble(results, parity_config().model)
  assert params.keys() == ref_params.keys()
  worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
  worst_param = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
  print(f'{layout}: worst relative loss error {worst_loss:.2e}, worst parameter error {worst_param:.2e}')
  for name in ref_params:
    np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _train_layout(workdir, kwargs):
  return _train(workdir, **kwargs)


# --- unit tests of the ops (in-process where a group of one suffices, else 2 ranks) -------


def test_boxes_tile_every_parameter_exactly_once():
  cfg = parity_config().model
  cfg.num_kv_heads = 2
  for tp, rep in ((1, 1), (2, 1), (4, 2)):
    specs = transformer.param_specs(cfg, tp)
    for name, spec in specs.items():
      cover = np.zeros(spec.shape, dtype=int)
      for t in range(tp):
        cover[tensor.tp_box(name, spec, tp, t, rep)] += 1
      copies = tp if tensor.is_tp_replicated(name) else rep if tensor.is_kv(name) else 1
      assert (cover == copies).all(), (name, tp)


def test_sharded_init_equals_the_slice_of_the_single_device_init():
  cfg = parity_config().model
  full = transformer.init(cfg, 5, tp=4)
  for t in range(4):
    mesh = meshes.Mesh(tp=4, rank=t, kv_replicator=2)
    local = transformer.init(cfg, 5, tp=4, boxes=tensor.boxes(cfg, mesh))
    for name, box in tensor.boxes(cfg, mesh).items():
      assert torch.equal(local[name], full[name][box]), name
  assert torch.equal(full['embed_tokens.weight'][cfg.vocab_size:], torch.zeros(512 - 256, 32))


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


def test_classification_of_replicated_parameters():
  assert tensor.is_tp_replicated('layers.0.input_layernorm.weight')
  assert tensor.is_tp_replicated('layers.0.self_attn.o_proj.bias')
  assert not tensor.is_tp_replicated('layers.0.self_attn.o_proj.weight')
  assert not tensor.is_tp_replicated('layers.0.self_attn.q_proj.bias')
  assert not tensor.is_tp_replicated('lm_head.weight')
  assert tensor.is_sequence_parallel_replicated('norm.weight')
  assert not tensor.is_sequence_parallel_replicated('embed_positions.weight')
  assert comm.group_size(None) == 1
