"""flatron's global parameters -> an NxD Training checkpoint tag (HF-style modules), the inverse
of checkpoint/nxd_params.py's merge: what NxD's GQAQKVColumnParallelLinear (fused), the stride-2
gate_up_proj, RowParallelLinear, ParallelEmbedding and ExpertMLPs hold on each (ep, tp, pp) rank.

Files are plain torch.save (NxD's loader reads either form: it takes a checkpoint for xser only
where a .tensors folder exists), with the `checkpoint` and `done` markers and a user_content.pt
holding the step; the tag is named as NxD Training names it, so it resumes step and samples.
"""
import os

import torch

from model import moe, param_table, transformer
from parallel import pipeline


def split(params, model_cfg, tp, pp=1, ep=1, kv_replicator=1, hw='trn1', cuts=()) -> dict:
  """{(ep, tp, pp): state dict} of NxD's HF-style modules for `params` (flatron's names)."""
  m, d = model_cfg, transformer.head_dim(model_cfg)
  heads, kv = m.num_attention_heads, param_table.kv_heads(model_cfg)
  if (kv_replicator == 1 and kv % tp) or (kv_replicator > 1 and kv * kv_replicator != tp):
    raise ValueError(f'num_kv_heads={kv} over tp={tp} with kv_replicator={kv_replicator}: NxD needs tp to divide the '
                     f'KV heads, or kv_replicator = tp / num_kv_heads ({tp // kv if tp % kv == 0 else "?"})')
  bounds = pipeline.stage_bounds(m.num_layers, pp, 1, tuple(cuts))
  vocab = m.vocab_size
  if vocab % tp:
    raise ValueError(f'vocab_size={vocab} is not divisible by tp={tp}: NxD\'s ParallelEmbedding does not pad')
  out = {(e, r, s): {} for e in range(ep) for r in range(tp) for s in range(pp)}
  rows = lambda w, r, parts: w.chunk(parts)[r].clone()  # noqa: E731
  for s, (lo, hi) in enumerate(bounds):
    for r in range(tp):
      shard = out[(0, r, s)]
      for i in range(lo, hi):
        p, n = f'layers.{i}.', f'model.layers.{i}.'
        q, k, v, o = _attention(params, p, r, tp, heads, kv, d, kv_replicator, hw)
        shard[n + 'self_attn.qkv_proj.weight_qkv'] = torch.cat([q, k, v])
        shard[n + 'self_attn.o_proj.weight'] = o
        shard[n + 'input_layernorm.weight'] = params[p + 'input_layernorm.weight'].clone()
        shard[n + 'post_attention_layernorm.weight'] = params[p + 'post_attention_layernorm.weight'].clone()
        if moe.is_moe_layer(m, i):
          shard[n + 'mlp.router.linear_router.weight'] = params[p + 'mlp.gate.weight'].clone()
          for e in range(ep):
            experts = out[(e, r, s)]
            gate, up, down = (params[p + 'mlp.experts.' + x].chunk(ep)[e] for x in ('gate_proj', 'up_proj', 'down_proj'))
            experts[n + 'mlp.expert_mlps.mlp_op.gate_up_proj.weight'] = torch.cat(
                [gate.chunk(tp, 1)[r].transpose(1, 2), up.chunk(tp, 1)[r].transpose(1, 2)], 2).contiguous()
            experts[n + 'mlp.expert_mlps.mlp_op.down_proj.weight'] = down.chunk(tp, 2)[r].transpose(1, 2).contiguous()
        else:
          shard[n + 'mlp.gate_up_proj.weight'] = torch.cat([rows(params[p + 'mlp.gate_proj.weight'], r, tp),
                                                            rows(params[p + 'mlp.up_proj.weight'], r, tp)])
          shard[n + 'mlp.down_proj.weight'] = params[p + 'mlp.down_proj.weight'].chunk(tp, 1)[r].clone()
      if s == 0:
        shard['model.embed_tokens.weight'] = rows(params['embed_tokens.weight'][:vocab], r, tp)
      if s == pp - 1:
        shard['model.norm.weight'] = params['norm.weight'].clone()
        head = params.get('lm_head.weight', params['embed_tokens.weight'])
        shard['lm_head.weight'] = rows(head[:vocab], r, tp)
  return out


def _attention(params, p, r, tp, heads, kv, d, rep, hw):
  """Rank r's (q, k, v, o) as NxD's GQAQKVColumnParallelLinear / RowParallelLinear hold them."""
  q, k, v, o = (params[p + f'self_attn.{x}_proj.weight'] for x in 'qkvo')
  nql = heads // tp
  if rep <= 1:
    kvl = kv // tp
    return (q[r * nql * d:(r + 1) * nql * d].clone(), k[r * kvl * d:(r + 1) * kvl * d].clone(),
            v[r * kvl * d:(r + 1) * kvl * d].clone(), o[:, r * nql * d:(r + 1) * nql * d].clone())
  g = r % kv if hw == 'trn1' else r // rep           # the KV head this rank holds
  block = (r % kv) * rep + r // kv if hw == 'trn1' else r
  return (q[block * nql * d:(block + 1) * nql * d].clone(), k[g * d:(g + 1) * d].clone(),
          v[g * d:(g + 1) * d].clone(), o[:, block * nql * d:(block + 1) * nql * d].clone())


def write_tag(root, shards, name, step, consumed_samples):
  """NxD's tag directory `root/<name>--step=S-consumed_samples=C.ckpt` for `shards`; returns it."""
  tag = os.path.join(root, f'{name}--step={step}-consumed_samples={float(consumed_samples)}.ckpt')
  os.makedirs(os.path.join(tag, 'model'), exist_ok=True)
  with open(os.path.join(tag, 'checkpoint'), 'w', encoding='utf-8') as f:
    f.write('1')
  ep = max(k[0] for k in shards) + 1
  for (e, r, s), state in shards.items():
    rank = f'dp_rank_00{f"_ep_rank_{e:02d}" if ep > 1 else ""}_tp_rank_{r:02d}_pp_rank_{s:02d}.pt'
    torch.save(state, os.path.join(tag, 'model', rank))
  torch.save({'global_step': step, 'epoch': 0}, os.path.join(tag, 'user_content.pt'))
  with open(os.path.join(tag, 'done'), 'w', encoding='utf-8') as f:     # last, as NxD writes it
    f.write('1')
  return tag
