"""parallel/sequence.py: under SP the column linears and the head keep the rank's shard of the
sequence, not the gathered input, and their gradients are bitwise those of plain F.linear on
the gathered input, at tp 2 and 4, with biases, in fp32 and bf16 (TP reductions in fp32)."""
import dataclasses
import os

import torch
import torch.nn.functional as F

from configs import llama_tiny
from model import transformer
from parallel import mesh as meshes, tensor
from tests import world


def _config(tp, bias):
  c = llama_tiny.get_config('test')
  m = c.model
  m.num_attention_heads, m.num_kv_heads, m.qkv_bias, m.has_bias = 4, 4, bias, bias
  c.data.seq_length, c.data.micro_batch_size = 16, 2
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.sequence_parallel, d.collective_timeout_s = tp, True, 60
  return c


def _grads(c, mesh, ops, dtype):
  m, b, s = c.model, c.data.micro_batch_size, c.data.seq_length
  params = transformer.init(m, 0, dtype=dtype, tp=mesh.tp, boxes=tensor.boxes(m, mesh))
  tokens = torch.randint(0, m.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
  batch = {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:], 'loss_mask': torch.ones(b, s),
           'sample_ids': torch.arange(b)}
  transformer.stage(params, batch, m, ops)[0].backward()
  return {name: p.grad for name, p in params.items()}


def _differing_gradients():
  """{(bias, dtype): names whose gradient differs in any bit between the shard-keeping linears
  and F.linear on the gathered input}."""
  out, mesh = {}, None
  for bias in (False, True):
    for dtype, reduce_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32)):
      c = _config(int(os.environ['WORLD_SIZE']), bias)
      mesh = mesh or meshes.init(c)
      keep = tensor.make_ops(mesh, True, reduce_dtype)
      plain = dataclasses.replace(keep, column_linear=F.linear, lm_head=F.linear)
      ours, theirs = _grads(c, mesh, keep, dtype), _grads(c, mesh, plain, dtype)
      out[(bias, str(dtype))] = sorted(n for n in ours if not torch.equal(ours[n], theirs[n]))
  return out


def test_keeping_the_shard_changes_no_gradient_bit():
  for n in (2, 4):
    for rank in world.run(_differing_gradients, n):
      assert rank and all(names == [] for names in rank.values()), rank
