"""parallel/sequence.py: under SP the column linears, LoRA's A and the head keep the rank's
shard of the sequence, not the gathered input, and their gradients are bitwise those of plain
F.linear on the gathered input, at tp 2 and 4, with biases, in fp32 and bf16 (TP reductions in
fp32), with LoRA on a frozen base; the input gathered again is dropped by its last reader."""
import dataclasses
import os

import torch
import torch.nn.functional as F

from configs import llama_tiny
from model import lora, transformer
from parallel import mesh as meshes, sequence, tensor
from tests import world


def _config(tp, bias, lora_rank=0):
  c = llama_tiny.get_config('test')
  m = c.model
  m.num_attention_heads, m.num_kv_heads, m.qkv_bias, m.has_bias = 4, 4, bias, bias
  m.peft.lora_rank, m.peft.target_modules = lora_rank, 'all-linear'
  c.data.seq_length, c.data.micro_batch_size = 16, 2
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.sequence_parallel, d.collective_timeout_s = tp, True, 60
  return c


def _grads(c, mesh, ops, dtype):
  m, b, s = c.model, c.data.micro_batch_size, c.data.seq_length
  params = transformer.init(m, 0, dtype=dtype, tp=mesh.tp, boxes=tensor.boxes(m, mesh))
  if m.peft.lora_rank:          # LoRA: a frozen base, and B non-zero so that A has a gradient
    for name, p in params.items():
      p.requires_grad_(lora.is_adapter(name))
      if name.endswith('lora_B.weight'):
        p.data.normal_(generator=torch.Generator().manual_seed(2))
  tokens = torch.randint(0, m.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
  batch = {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:], 'loss_mask': torch.ones(b, s),
           'sample_ids': torch.arange(b)}
  transformer.stage(params, batch, m, ops)[0].backward()
  return {name: p.grad for name, p in params.items() if p.requires_grad}


def _differing_gradients():
  """{(bias, dtype): names whose gradient differs in any bit between the shard-keeping linears
  and F.linear on the gathered input}."""
  out, mesh = {}, None
  for bias, lora_rank in ((False, 0), (True, 0), (False, 4)):
    for dtype, reduce_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32)):
      c = _config(int(os.environ['WORLD_SIZE']), bias, lora_rank)
      mesh = mesh or meshes.init(c)
      keep = tensor.make_ops(mesh, True, reduce_dtype)
      plain = dataclasses.replace(keep, column_linear=F.linear, lm_head=F.linear)
      ours, theirs = _grads(c, mesh, keep, dtype), _grads(c, mesh, plain, dtype)
      assert ours.keys() == theirs.keys() and all(g is not None for g in ours.values())
      out[(bias, lora_rank, str(dtype))] = sorted(n for n in ours if not torch.equal(ours[n], theirs[n]))
  return out


def test_keeping_the_shard_changes_no_gradient_bit():
  for n in (2, 4):
    for rank in world.run(_differing_gradients, n):
      assert rank and all(names == [] for names in rank.values()), rank


def test_the_input_gathered_again_is_dropped_by_its_last_reader():
  shard = torch.randn(2, 3, 4, requires_grad=True)
  gathered = []

  def build(x):                 # a stand-in for the all-gather: two copies of the shard
    gathered.append(torch.cat([x, x], dim=1))
    return gathered[-1]

  full = sequence.gather(shard, build)
  regather = full._flatron_shard[1]    # pylint: disable=protected-access
  w1, w2, frozen = torch.randn(5, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True), torch.randn(7, 4)
  loss = sum(sequence.linear(full, w).sum() for w in (w1, w2, frozen))
  assert regather.readers == 2                  # the frozen weight needs no input in backward
  loss.backward()
  assert len(gathered) == 2 and regather.readers == 0 and regather.full is None   # built once, then dropped
  x = torch.cat([shard, shard], 1).detach()
  assert torch.equal(w1.grad, torch.ones(2, 6, 5).reshape(-1, 5).t().mm(x.reshape(-1, 4)))
