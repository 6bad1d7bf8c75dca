"""Tensor and sequence parallelism (Megatron): which box of each parameter a TP rank holds,
and the `Ops` that make the single-device model run on those boxes.

Each parameter's layout is declared where the model defines it (ParamSpec.layout): column
(output rows split: q/k/v, gate/up, their biases), vocab, row (input columns split, output
all-reduced or, under SP, reduce-scattered: o_proj, down_proj), MoE's experts split the same
way, each expert on its f (model/moe.py); the rest whole. With tp > num_kv_heads each KV head
is held by `kv_replicator` consecutive TP ranks (rank r holds KV head r // kv_replicator).
"""
import dataclasses

import torch
import torch.nn.functional as F

from model import layers, moe, param_init, param_table
from numerics import fp8, precision
from parallel import comm, context, experts, sequence



def check(model_cfg, strategy, seq_length) -> list:
  """Whether the model splits over distributed_strategy's TP degree (degrees already > 0):
  heads and FFN columns evenly, KV heads evenly or replicated exactly, SP's sequence evenly."""
  problems, tp, replicator = [], strategy.tensor_model_parallel_size, strategy.kv_replicator
  heads, kv = model_cfg.num_attention_heads, param_table.kv_heads(model_cfg)
  if heads % tp:
    problems.append(f'model.num_attention_heads={heads} is not divisible by '
                    f'distributed_strategy.tensor_model_parallel_size={tp}')
  if model_cfg.ffn_hidden_size % tp:
    problems.append(f'model.ffn_hidden_size={model_cfg.ffn_hidden_size} is not divisible by '
                    f'distributed_strategy.tensor_model_parallel_size={tp}')
  if moe.enabled(model_cfg):
    for key, size in (('ffn_hidden_size', moe.expert_ffn_size(model_cfg)),
                      ('shared_expert_intermediate_size', model_cfg.moe.shared_expert_intermediate_size)):
      if size % tp:
        problems.append(f'model.moe.{key}={size} (the experts\' inner width) is not divisible by '
                        f'distributed_strategy.tensor_model_parallel_size={tp}')
  if 0 < kv < tp:                  # kv <= 0 is model/checks.py's to report; both branches divide by it
    if kv * replicator != tp:
      problems.append(f'tensor_model_parallel_size={tp} > model.num_kv_heads={kv}: set '
                      f'distributed_strategy.kv_replicator={tp // kv if tp % kv == 0 else "?"} so that '
                      f'num_kv_heads x kv_replicator = tp (now {kv} x {replicator})'
                      + ('' if tp % kv == 0 else '; tp must be a multiple of num_kv_heads'))
  elif kv > 0:
    if kv % tp:
      problems.append(f'model.num_kv_heads={kv} is not divisible by tensor_model_parallel_size={tp}')
    if replicator != 1:
      problems.append(f'distributed_strategy.kv_replicator={replicator} needs tp > num_kv_heads '
                      f'({tp} <= {kv}); set it to 1')
  if strategy.sequence_parallel and seq_length % tp:
    problems.append(f'data.seq_length={seq_length} is not divisible by tensor_model_parallel_size={tp} '
                    '(needed by sequence_parallel)')
  return problems


VOCAB_TABLES = ('embed_tokens.weight', 'lm_head.weight')   # rows padded past the vocabulary

# The dim each declared layout (model/transformer.py LAYOUTS) splits over TP; the rest are whole.
SPLIT_DIMS = {'vocab': 0, 'column': 0, 'column_kv': 0, 'row': 1, 'expert_column': 1, 'expert_row': 2}


def layouts(model_cfg) -> dict:
  """name -> the layout the model declares for it (param_specs refuses one that declares none)."""
  return {name: spec.layout for name, spec in param_table.param_specs(model_cfg).items()}


def split_dim(layout):
  """The dim of a parameter of `layout` split over TP (0 rows, 1 columns...), or None when whole."""
  return SPLIT_DIMS.get(layout)


def is_kv(layout):
  """Boxes of a KV head (held by kv_replicator ranks when tp > num_kv_heads)."""
  return layout == 'column_kv'


def is_tp_replicated(layout):
  """Parameters every TP rank holds whole (norms, row-parallel biases, learned positions,
  LoRA's A of column-parallel and B of row-parallel layers)."""
  return split_dim(layout) is None


def is_tp_partial(layout):
  """Replicated parameters whose gradient each TP rank computes only in part, from its shard
  of the layer (its heads): LoRA's replicated factors and the per-head q/k norms. Summed over TP
  at every layout."""
  return layout == 'tp_partial'


def is_sequence_parallel_replicated(layout):
  """Replicated parameters applied to sequence shards under SP: their grads need a TP sum."""
  return layout == 'replicated'


def _split(size, parts, index):
  chunk = size // parts
  return slice(index * chunk, (index + 1) * chunk)


def tp_box(spec, tp, tp_rank, kv_replicator=1):
  """The slices of the global parameter of `spec` that TP rank `tp_rank` holds."""
  box = list(param_init.full_box(spec.shape))
  dim = split_dim(spec.layout)
  if is_kv(spec.layout):
    box[0] = _split(spec.shape[0], tp // kv_replicator, tp_rank // kv_replicator)
  elif dim is not None:
    box[dim] = _split(spec.shape[dim], tp, tp_rank)
  return tuple(box)


def boxes(model_cfg, mesh, names=None):
  """name -> box for this rank (all parameters, or `names`), at the TP-padded vocabulary."""
  specs = param_table.param_specs(model_cfg, mesh.tp)
  return {name: experts.ep_box(name, tp_box(specs[name], mesh.tp, mesh.tp_rank, mesh.kv_replicator),
                               specs[name], mesh)
          for name in (names or specs)}


def vocab_parallel_embedding(ids_bs, table_vh, group):
  """Each rank looks up the ids in its vocab range; the partial rows are summed over TP."""
  rows = table_vh.shape[0]
  start = comm.group_rank(group) * rows
  local = ids_bs - start
  outside = (local < 0) | (local >= rows)
  out = F.embedding(local.masked_fill(outside, 0), table_vh).masked_fill(outside[..., None], 0.0)
  return comm.reduce_from_group(out, group)


class _VocabParallelLoss(torch.autograd.Function):
  """log sum_v exp(z_v) - z_label over vocab-sharded logits, the max and both sums reduced over
  the TP group; as model/cross_entropy.py's tp = 1 loss, one fp32 copy of the shard is kept
  and the backward turns it in place into the gradient, g (exp(z - max - log S) - onehot):
  8 N V' bytes at the loss's peak (the logits and the copy) where autograd's graph of the same
  ops held four fp32 copies, and their churn fragmented the CPU heap (llama_50m, tp2: +450 MiB
  of peak RSS)."""

  @staticmethod
  def forward(ctx, logits_nv, labels_n, vocab_size, group):
    z = logits_nv.to(torch.float32, copy=True)
    width = z.shape[-1]
    start = comm.group_rank(group) * width
    z[:, max(vocab_size - start, 0):] = float('-inf')      # padded vocabulary rows
    top = comm.all_reduce_(z.max(dim=-1).values, group, op=torch.distributed.ReduceOp.MAX,
                           name='all_reduce(max logit)')
    z.sub_(top[:, None])
    rows = max(1, 2**21 // max(width, 1))                    # exp in pieces of ~8 MiB, not a copy of z
    sum_exp = torch.cat([piece.exp().sum(dim=-1) for piece in z.split(rows)])
    sum_exp = comm.all_reduce_(sum_exp, group, name='all_reduce(sum exp)')
    local = labels_n - start
    mine = (local >= 0) & (local < width)
    index = local.clamp(0, width - 1)[:, None]
    picked = torch.where(mine, z.gather(-1, index).squeeze(-1), 0.0)
    label_logit = comm.all_reduce_(picked, group, name='all_reduce(label logit)')
    ctx.save_for_backward(z, sum_exp, index, mine)
    ctx.dtype, ctx.spent = logits_nv.dtype, False
    return sum_exp.log() - label_logit

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, grad_n):
    if ctx.spent:
      raise RuntimeError('the vocab-parallel cross-entropy\'s backward ran twice (retain_graph): its '
                         'saved logits were consumed by the first; run the forward again')
    ctx.spent = True
    z, sum_exp, index, mine = ctx.saved_tensors
    g = grad_n.float()[:, None]
    grad = z.sub_(sum_exp.log()[:, None]).exp_().mul_(g)     # softmax x g
    grad.scatter_add_(1, index, torch.where(mine[:, None], -g, 0.0))      # - onehot x g, this shard's labels
    return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits_bsv, labels_bs, vocab_size, group):
  """Per-token loss [b, s] in fp32 over vocab-sharded logits without gathering them; padded ids
  excluded (_VocabParallelLoss)."""
  loss = _VocabParallelLoss.apply(logits_bsv.flatten(0, 1), labels_bs.flatten(), vocab_size, group)
  return loss.view_as(labels_bs)


VOCAB_REDUCE_OPS = {'max': torch.distributed.ReduceOp.MAX, 'sum': torch.distributed.ReduceOp.SUM}


def _in_dtype(collective, dtype):
  """`collective` run in `dtype` (None: the tensor's own), the result back in the tensor's:
  casts are differentiable, so a backward reduction runs in `dtype` too."""
  if dtype is None:
    return collective
  return lambda x: collective(x) if x.dtype == dtype else collective(x.to(dtype)).to(x.dtype)


def make_ops(mesh, sequence_parallel=False, reduce_dtype=None):
  """The model's Ops for this rank's TP group (plain PyTorch when tp == 1). `reduce_dtype`:
  the dtype TP reductions sum in (precision.parallel_layers_reduce_dtype), None = the
  activations' own."""
  group = mesh.tp_group
  if group is None:
    return context.with_ring(layers.LOCAL_OPS, mesh)
  sp = sequence_parallel
  leave = _in_dtype((lambda x: comm.reduce_scatter_seq(x, group)) if sp else (lambda x: comm.reduce_from_group(x, group)),
                    reduce_dtype)
  copy = _in_dtype(lambda x: comm.copy_to_group(x, group), reduce_dtype)   # Megatron's f: all-reduce in backward
  # entering a TP region: SP's all-gather (reduce-scatter in backward; the column linears keep
  # the shard and gather it again: parallel/sequence.py), else f
  if sp:
    build = _in_dtype(lambda x: comm.gather_seq(x, group), reduce_dtype)   # run again, unchanged, in backward
    enter = lambda x: sequence.gather(x, build)
  else:
    enter = copy
  column = sequence.linear if sp else fp8.linear

  def row_linear(x, w, b=None, partial=None, gemms=None):
    out = fp8.linear(x, w, gemms=gemms)
    out = leave(out if partial is None else out + partial)
    return out if b is None else out + b

  def mask_for_slice(mask_b_, kind):
    if kind == 'seq':
      return comm.own_chunk(mask_b_, group, 1) if sp else mask_b_
    return comm.own_chunk(mask_b_, group, -1 if kind == 'ffn' else 1)

  return context.with_ring(layers.Ops(
      column_linear=column,
      row_linear=row_linear,
      embed=lambda ids, table: vocab_parallel_embedding(ids, table, group),
      lm_head=column,
      cross_entropy=lambda logits, labels, v: vocab_parallel_cross_entropy(logits, labels, v, group),
      vocab_reduce=lambda x, op: comm.all_reduce_(x, group, op=VOCAB_REDUCE_OPS[op],
                                                  name=f'all_reduce(chunked cross-entropy {op})'),
      vocab_rank=comm.group_rank(group),
      full_input=enter,
      copy_to_tp=copy,
      reduce_over_tp=leave,
      slice_residual=(lambda x: comm.split_seq(x, group)) if sp else (lambda x: x),
      residual_slices=mesh.tp if sp else 1,
      mask_for_slice=mask_for_slice,
      sum_over_heads=lambda partial, kv: _sum_over_heads(partial, kv, group, mesh.kv_replicator),
  ), mesh)


def _sum_over_heads(partial, kv, group, kv_replicator):
  """A projection's sum over its heads from each TP rank's partial sum; a KV head held by
  kv_replicator ranks is in as many partial sums."""
  total = comm.sum_over_group(partial, group)
  return total / kv_replicator if kv and kv_replicator > 1 else total


def fp8_gemms(name, mesh):
  """precision.fp8's GEMMs for the column- and row-parallel linears, each amax taken over a split
  dim completed (MAX) over its group: N of a column-parallel weight and K of a row-parallel one
  over TP, M (tokens) over CP; so every layout scales as one device."""
  why = fp8.probe(mesh.device)
  if why:
    raise fp8.Float8Unsupported(f'precision.fp8={name!r} cannot run on {mesh.device} (torch {torch.__version__}): '
                                f'{why}; FP8 GEMMs need an sm_89+ GPU (H100, L4, ...) or the CPU: unset precision.fp8')

  def over(group, what):
    if group is None:
      return None
    return lambda amax: comm.all_reduce_(amax.clone(), group, op=torch.distributed.ReduceOp.MAX,
                                         name=f'all_reduce(fp8 amax over {what})')
  tp, cp = over(mesh.tp_group, 'tp'), over(mesh.cp_group, 'cp')
  rec = fp8.recipe(name)
  return {'column': fp8.Gemms(rec, {'M': cp, 'N': tp}), 'row': fp8.Gemms(rec, {'M': cp, 'K': tp})}


def config_ops(config, mesh):
  """make_ops as a config asks: sequence parallel, and the TP reductions' dtype."""
  ops = make_ops(mesh, config.distributed_strategy.sequence_parallel,
                 precision.parallel_layers_reduce_dtype(config.precision))
  if config.precision.get('fp8'):
    ops = dataclasses.replace(ops, fp8_gemms=fp8_gemms(config.precision.fp8, mesh))
  if config.exp_manager.get('log_layer_stats'):       # parallel/layer_stats.py's per-layer MoE loads
    ops = dataclasses.replace(ops, expert_loads=True)
  if mesh.ep > 1:
    ops = dataclasses.replace(ops, expert_ffn=experts.expert_ffn(mesh.ep_group, mesh.ep),
                              expert_buffers=experts.expert_buffers(mesh.ep_group, mesh.ep))
  return ops
