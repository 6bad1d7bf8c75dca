"""NxD Training's model shards <-> flatron's global parameters (Llama / Mixtral names).

The shards are NxD's modules' own (NxD Core 2.26, NxD Training 2.26):
  HF style (model.layers.N...)
    self_attn.qkv_proj.weight_qkv  GQAQKVColumnParallelLinear, a rank's rows [Q | K | V] (or
                                   weight_q / weight_k / weight_v; plain q/k/v_proj otherwise;
                                   qkv_proj.weight [q_r; k_r; v_r] for multi-head attention).
                                   With kv_replicator m > 1 each rank holds one KV head:
                                   trn1: KV head r % g, query block (r % g) m + r // m... (below),
                                   trn2: KV head r // m, its query heads in order.
    self_attn.o_proj.weight        RowParallelLinear: columns follow the query heads
    mlp.gate_up_proj.weight        ColumnParallelLinear, stride 2: a rank's rows [gate_r; up_r]
    mlp.down_proj.weight           RowParallelLinear (dim 1)
    mlp.router.linear_router.weight                    Mixtral's router [E, h], whole
    mlp.expert_mlps.mlp_op.gate_up_proj.weight         [E/ep, h, 2f/tp]: [gate_r | up_r] on dim 2
    mlp.expert_mlps.mlp_op.down_proj.weight            [E/ep, f/tp, h]
    embed_tokens / lm_head         vocab rows split over TP; norms whole on every rank
  Megatron style (language_model.encoder.layers.N...): query_key_value [np, 3, d] per rank
  (query + key_value [nk, 2, d] with GQA), dense, dense_h_to_4h [gate_r; up_r], dense_4h_to_h,
  word_embeddings / output_layer (vocab padded past the tokenizer's), input_layernorm,
  post_attention_layernorm, final_layernorm.
Pipeline stages keep global layer names: a model is the union of its pp files.
"""
import os
import re

import torch

from checkpoint import nxd_files
from model import moe, param_table, transformer

HW = ('trn1', 'trn2')
LAYER = re.compile(r'(?:^|\.)layers\.(\d+)\.')


def _shards(tag):
  """({(ep, tp): name -> tensor}: each (ep, tp) rank's state dict over all pp stages, [the layer
  indices each pp stage holds])."""
  out, stages = {}, [set() for _ in range(tag.pp)]
  for (ep, tp, pp) in sorted(tag.files):
    part = {n.replace('_checkpoint_wrapped_module.', ''): t for n, t in nxd_files.read_rank(tag, ep, tp, pp).items()}
    out.setdefault((ep, tp), {}).update(part)
    stages[pp].update(int(m.group(1)) for m in map(LAYER.search, part) if m)
  return out, stages


def merge(tag, model_cfg, hw=None) -> dict:
  """flatron's global parameters (vocab padded as ours) from an NxD tag's model shards. `hw`
  (trn1 | trn2) orders the heads when KV heads were replicated; None: the one whose replica
  groups hold equal copies (each layout groups other ranks)."""
  if hw is not None and hw not in HW:
    raise nxd_files.NxDCheckpointError(f'hw={hw!r}: one of {HW} (the hardware the checkpoint was trained on)')
  shards, stages = _shards(tag)
  tp, ep = tag.tp, tag.ep
  ranks = [shards[(0, r)] for r in range(tp)]
  megatron = any(n.startswith('language_model.') for n in ranks[0])
  names = _megatron_names if megatron else _hf_names
  specs = param_table.param_specs(model_cfg, adapters=False)
  m, d = model_cfg, transformer.head_dim(model_cfg)
  _check_degrees(tag, shards, stages, names, m, d)
  out, used = {}, set()

  def has(key, rank=0):
    return key is not None and key in shards[(0, rank)]

  def take(key, rank=0, e=0):
    used.add(key)
    src = shards[(e, rank)]
    if key not in src:
      raise nxd_files.NxDCheckpointError(f'{tag.path}: tensor {key} is missing from its (ep {e}, tp {rank}) shards; '
                                         'is this checkpoint of the model the config describes?')
    return src[key]

  def cat(key, dim):
    return torch.cat([take(key, r) for r in range(tp)], dim)

  for i in range(m.num_layers):
    n = names(i)
    q, k, v, o = _attention(take, has, n, tp, m, d, hw, tag.path)
    p = f'layers.{i}.'
    out.update({p + 'self_attn.q_proj.weight': q, p + 'self_attn.k_proj.weight': k,
                p + 'self_attn.v_proj.weight': v, p + 'self_attn.o_proj.weight': o,
                p + 'input_layernorm.weight': take(n['input_norm']),
                p + 'post_attention_layernorm.weight': take(n['post_norm'])})
    if moe.is_moe_layer(m, i):
      out[p + 'mlp.gate.weight'] = take(n['router'])
      f = take(n['experts_gate_up']).shape[-1] // 2        # the checkpoint's expert width / tp
      gate = torch.cat([torch.cat([take(n['experts_gate_up'], r, e)[..., :f] for r in range(tp)], 2) for e in range(ep)])
      up = torch.cat([torch.cat([take(n['experts_gate_up'], r, e)[..., f:] for r in range(tp)], 2) for e in range(ep)])
      down = torch.cat([torch.cat([take(n['experts_down'], r, e) for r in range(tp)], 1) for e in range(ep)])
      out.update({p + 'mlp.experts.gate_proj': gate.transpose(1, 2).contiguous(),
                  p + 'mlp.experts.up_proj': up.transpose(1, 2).contiguous(),
                  p + 'mlp.experts.down_proj': down.transpose(1, 2).contiguous()})
    else:
      if has(n['gate_up']):                                # a rank's [gate_r; up_r]
        parts = [take(n['gate_up'], r) for r in range(tp)]
        gate, up = (torch.cat([w[:w.shape[0] // 2] for w in parts]), torch.cat([w[w.shape[0] // 2:] for w in parts]))
      else:
        gate, up = cat(n['gate'], 0), cat(n['up'], 0)
      out.update({p + 'mlp.gate_proj.weight': gate, p + 'mlp.up_proj.weight': up,
                  p + 'mlp.down_proj.weight': cat(n['down'], 1)})
  top = names(None)
  out['norm.weight'] = take(top['final_norm'])
  vocab = m.vocab_size
  out['embed_tokens.weight'] = cat(top['embed'], 0)[:vocab]
  if 'lm_head.weight' in specs:
    out['lm_head.weight'] = cat(top['head'], 0)[:vocab] if has(top['head']) else out['embed_tokens.weight']
  for name in ('embed_tokens.weight', 'lm_head.weight'):
    if name in out:
      padded = out[name].new_zeros(specs[name].shape)
      padded[:vocab] = out[name]
      out[name] = padded
  _check(tag, out, specs, shards, used)
  return {name: out[name] for name in specs}


def _attention(take, has, n, tp, m, d, hw, where):
  """(q, k, v, o) global weights of one layer from its tp shards."""
  heads, kv = m.num_attention_heads, param_table.kv_heads(m)
  q_r, k_r, v_r = [], [], []
  for r in range(tp):
    q, k, v = _qkv(take, has, n, r, heads // tp, d)
    q_r.append(q)
    k_r.append(k)
    v_r.append(v)
  o_r = [take(n['o'], r) for r in range(tp)]
  per_rank_kv = k_r[0].shape[0] // d
  rep = per_rank_kv * tp // kv                      # kv_replicator the shards were saved with
  if rep <= 1:
    return torch.cat(q_r), torch.cat(k_r), torch.cat(v_r), torch.cat(o_r, 1)
  if per_rank_kv != 1:
    raise nxd_files.NxDCheckpointError(f'{where}: {per_rank_kv} KV heads per rank with kv_replicator {rep}: NxD '
                                       'replicates KV heads only to one per rank (kv_replicator = tp / num_kv_heads)')
  owners = {'trn1': lambda r: r % kv, 'trn2': lambda r: r // rep}
  fits = [h for h in HW if _replicas_agree(k_r, v_r, owners[h], kv)]
  if hw is None and not fits:
    raise nxd_files.NxDCheckpointError(
        f'{where}: with kv_replicator {rep} neither trn1\'s nor trn2\'s replica groups hold equal K/V copies (a trn2 '
        'run started from NxD\'s own random init has no single KV head per group to recover)')
  if hw is not None and hw not in fits:
    other = HW[1 - HW.index(hw)]
    raise nxd_files.NxDCheckpointError(
        f'{where}: the ranks that hold each KV head under {hw}\'s layout hold different K/V rows'
        + (f'; the checkpoint is in {other}\'s order: pass hw={other} (--hw={other})' if other in fits else
           ' (nor do trn2\'s or trn1\'s: a trn2 run from NxD\'s own random init has no single KV head per group)'))
  hw = hw or fits[0]
  owner = owners[hw]
  block = (lambda r: (r % kv) * rep + r // kv) if hw == 'trn1' else (lambda r: r)
  order = sorted(range(tp), key=block)
  first = {owner(r): r for r in reversed(range(tp))}
  return (torch.cat([q_r[r] for r in order]), torch.cat([k_r[first[g]] for g in range(kv)]),
          torch.cat([v_r[first[g]] for g in range(kv)]), torch.cat([o_r[r] for r in order], 1))


def _qkv(take, has, n, r, q_heads, d):
  """(q, k, v) rows of tp rank r, whichever of NxD's attention modules wrote them."""
  if has(n.get('qkv_fused'), r):            # GQAQKVColumnParallelLinear, fused: [Q | K | V]
    fused = take(n['qkv_fused'], r)
    kv = (fused.shape[0] - q_heads * d) // 2
    return fused.split([q_heads * d, kv, kv])
  for keys in (('q_sep', 'k_sep', 'v_sep'), ('q', 'k', 'v')):
    if has(n.get(keys[0]), r):
      return tuple(take(n[key], r) for key in keys)
  if has(n.get('mha'), r):                  # multi-head: [q_r; k_r; v_r] (HF style), [np, 3, d] (Megatron)
    w = take(n['mha'], r)
    if n.get('mha_per_head'):
      x = w.view(q_heads, 3, d, w.shape[-1])
      return tuple(x[:, j].reshape(q_heads * d, -1) for j in range(3))
    return w.chunk(3)
  if has(n.get('kv_pair'), r):              # Megatron GQA: query, key_value [nk, 2, d]
    q, kv = take(n['q_only'], r), take(n['kv_pair'], r)
    x = kv.view(-1, 2, d, kv.shape[-1])
    return q, x[:, 0].reshape(-1, kv.shape[-1]), x[:, 1].reshape(-1, kv.shape[-1])
  raise nxd_files.NxDCheckpointError(f'no attention weights beside {n["o"]} on tp rank {r}')


def _replicas_agree(k_r, v_r, owner, kv):
  """Whether every rank `owner` says holds KV head g holds the same K and V (the copies)."""
  for g in range(kv):
    group = [r for r in range(len(k_r)) if owner(r) == g]
    if not group or any(not torch.equal(k_r[r], k_r[group[0]]) or not torch.equal(v_r[r], v_r[group[0]]) for r in group):
      return False
  return True


def _hf_names(i):
  if i is None:
    return {'final_norm': 'model.norm.weight', 'embed': 'model.embed_tokens.weight', 'head': 'lm_head.weight'}
  p = f'model.layers.{i}.'
  return {'qkv_fused': p + 'self_attn.qkv_proj.weight_qkv', 'q_sep': p + 'self_attn.qkv_proj.weight_q',
          'k_sep': p + 'self_attn.qkv_proj.weight_k', 'v_sep': p + 'self_attn.qkv_proj.weight_v',
          'q': p + 'self_attn.q_proj.weight', 'k': p + 'self_attn.k_proj.weight', 'v': p + 'self_attn.v_proj.weight',
          'mha': p + 'self_attn.qkv_proj.weight', 'o': p + 'self_attn.o_proj.weight',
          'input_norm': p + 'input_layernorm.weight', 'post_norm': p + 'post_attention_layernorm.weight',
          'gate_up': p + 'mlp.gate_up_proj.weight', 'gate': p + 'mlp.gate_proj.weight', 'up': p + 'mlp.up_proj.weight',
          'down': p + 'mlp.down_proj.weight', 'router': p + 'mlp.router.linear_router.weight',
          'experts_gate_up': p + 'mlp.expert_mlps.mlp_op.gate_up_proj.weight',
          'experts_down': p + 'mlp.expert_mlps.mlp_op.down_proj.weight'}


def _megatron_names(i):
  if i is None:
    return {'final_norm': 'language_model.encoder.final_layernorm.weight',
            'embed': 'language_model.embedding.word_embeddings.weight', 'head': 'language_model.output_layer.weight'}
  p = f'language_model.encoder.layers.{i}.'
  a = p + 'self_attention.'
  return {'mha': a + 'query_key_value.weight', 'mha_per_head': True, 'q_only': a + 'query.weight',
          'kv_pair': a + 'key_value.weight', 'o': a + 'dense.weight',
          'input_norm': p + 'input_layernorm.weight', 'post_norm': p + 'post_attention_layernorm.weight',
          'gate_up': p + 'mlp.dense_h_to_4h.weight',
          'down': p + 'mlp.dense_4h_to_h.weight', 'router': p + 'mlp.moe.router.linear_router.weight',
          'experts_gate_up': p + 'mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight',
          'experts_down': p + 'mlp.moe.expert_mlps.mlp_op.down_proj.weight'}


def _check_degrees(tag, shards, stages, names, m, d):
  """Refuse, naming the files, a checkpoint read at a smaller layout than it was saved at: the
  degrees come from the file names, so a directory missing every file of its last tp rank (or pp
  stage, or ep rank) reads as a smaller one. The shards' shapes times the degrees must make the
  model: its layers and final norm, vocabulary rows, attention columns and experts."""
  where = tag.path if tag.legacy else os.path.join(tag.path, 'model')
  ep_named = tag.ep > 1 or '_ep_rank_' in os.path.basename(tag.files[(0, 0, 0)])

  def missing(what, eps, tps, pps, unknown):
    files = [nxd_files.rank_name(tag.legacy, ep_named or len(eps) > 1 or max(eps) > 0, e, t, p)
             for e in eps for t in tps for p in pps]
    listed = ', '.join(files[:2]) + (' ...' if len(files) > 2 or unknown else '')
    return f'{what}{" (and of any after it)" if unknown else ""} are missing ({listed}); copy the whole checkpoint directory'

  def span(n, first=0):
    return f'{first}..{n - 1}'

  first, top = shards[(0, 0)], names(None)
  held = sorted(set().union(*stages))
  has_norm = top['final_norm'] in first
  if held == list(range(len(held))) and (len(held) < m.num_layers or not has_norm):
    layers = f'layers {span(len(held))}' if held else 'no layers'
    if not has_norm:
      sizes, left = {len(s) for s in stages}, m.num_layers - len(held)   # stages of one size: as many more as
      exact = len(sizes) == 1 and min(sizes) and left and left % min(sizes) == 0   # the layers left make
      lost = range(tag.pp, tag.pp + (left // min(sizes) if exact else 1))
      which = f'pp stage {lost[0]}' if len(lost) == 1 else f'pp stages {span(lost[-1] + 1, lost[0])}'
      raise nxd_files.NxDCheckpointError(
          f'{where} holds {layers} of the model\'s {m.num_layers} (num_layers) and no final norm ({top["final_norm"]}): '
          + missing(f'the files of {which}', range(tag.ep), range(tag.tp), lost, not exact))
    raise nxd_files.NxDCheckpointError(
        f'{where} holds {layers} and its final norm, the config {m.num_layers} layers (num_layers); set the model to '
        'the checkpoint\'s')

  heads = m.num_attention_heads * d
  o = first.get(names(held[0])['o']) if held else None
  cols = o.shape[-1] if o is not None and o.dim() == 2 else None
  rows = first[top['embed']].shape[0] if top['embed'] in first else None
  short = ([f'its embedding has {rows * tag.tp} of the model\'s {m.vocab_size} vocabulary rows']
           if rows is not None and rows * tag.tp < m.vocab_size else []) + (
           [f'its attention output projection has {cols * tag.tp} of the model\'s {heads} input columns (heads x head_dim)']
           if cols and cols * tag.tp < heads else [])
  if short:
    true_tp = heads // cols if cols and heads % cols == 0 else None
    if true_tp is None or true_tp > tag.tp:
      lost = range(tag.tp, true_tp or tag.tp + 1)
      which = f'tp rank {lost[0]}' if len(lost) == 1 else f'tp ranks {span(lost[-1] + 1, lost[0])}'
      raise nxd_files.NxDCheckpointError(
          f'{where} holds tp ranks {span(tag.tp)} but {short[0]}: '
          + missing(f'the files of {which}', range(tag.ep), lost, range(tag.pp), true_tp is None))
    raise nxd_files.NxDCheckpointError(f'{where}: {short[0]} at tp {tag.tp} (its attention matches tp {tag.tp}); set the model '
                                       'to the checkpoint\'s (vocab_size)')

  experts = m.moe.num_experts if moe.enabled(m) else 0
  layer = next((i for i in held if moe.is_moe_layer(m, i)), None)
  w = first.get(names(layer)['experts_down']) if layer is not None else None
  if w is not None and w.dim() == 3 and w.shape[0] * tag.ep < experts:
    true_ep = experts // w.shape[0] if experts % w.shape[0] == 0 else None
    lost = range(tag.ep, true_ep or tag.ep + 1)
    which = f'ep rank {lost[0]}' if len(lost) == 1 else f'ep ranks {span(lost[-1] + 1, lost[0])}'
    raise nxd_files.NxDCheckpointError(
        f'{where} holds ep ranks {span(tag.ep)} but {w.shape[0] * tag.ep} of the model\'s {experts} experts '
        f'(num_experts): ' + missing(f'the files of {which}', lost, range(tag.tp), range(tag.pp), true_ep is None))


def _check(tag, out, specs, shards, used):
  """Every parameter built at its shape; no tensor of the checkpoint left unread."""
  for name, spec in specs.items():
    if name not in out:
      raise nxd_files.NxDCheckpointError(f'{tag.path}: nothing for {name} in the checkpoint')
    if tuple(out[name].shape) != tuple(spec.shape):
      raise nxd_files.NxDCheckpointError(f'{tag.path}: {name} is {tuple(out[name].shape)} in the checkpoint, '
                                         f'{tuple(spec.shape)} in the config; set the model to the checkpoint\'s')
  ignored = ('rotary_emb.inv_freq',)
  left = sorted({n for s in shards.values() for n in s} - used)
  left = [n for n in left if not n.endswith(ignored) and not (n == 'lm_head.weight' and 'lm_head.weight' not in specs)]
  if left:
    raise nxd_files.NxDCheckpointError(f'{tag.path}: tensors the config has no place for: {", ".join(left[:5])}'
                                       f'{f" (+{len(left) - 5} more)" if len(left) > 5 else ""}; is the config this '
                                       'checkpoint\'s model?')
