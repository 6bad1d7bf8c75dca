"""Context parallelism: the `cp` ranks of a sequence each hold a slice of it.

Every cp rank loads the same micro batches (the loader knows only dp); `slice_batch` cuts
each rank's slice where the batch reaches the model: tokens, labels, loss mask, RoPE
positions and document ids, in the load-balanced layout (parallel/ring_attention.py:
2 cp chunks, rank i holds chunks i and 2cp-1-i). Everything but attention works per token
and runs unchanged on the slice; attention is the ring (`with_ring` puts it in the Ops).
The loss stays normalized by the global batch's token count (counted on the whole rows
before slicing); the loss sums and the weights' gradients are summed over dp x cp
(mesh.dp_cp_group): parallel/passes.py and optim/update.py. Preference objectives' per-row
sums are added over cp (`Ops.row_sum`) before their nonlinear loss; dropout masks are drawn for
whole rows and cut to this rank's positions (`Ops.context_slice`).
"""
import dataclasses

import torch

import host_values
from model import layers
from parallel import comm, ring_attention, ring_blocks

ROW_KEYS = ('tokens', 'labels', 'loss_mask', 'position_ids', 'segment_ids', 'chosen_mask', 'rejected_mask')
# The ring computes blocks of at most this many queries x keys: its transient scores stay
# O(PIECE^2) per head, not O((s / cp)^2), and finer pieces skip more of a window's masked blocks.
PIECE = 512


def slice_batch(batch, cp, cp_rank):
  """This cp rank's slice of a micro batch ([b, s] fields -> [b, s / cp]). The whole rows'
  document ids go along as `ring_segment_ids` [b, s] in layout order (rank after rank), for
  the ring's masks of the other ranks' blocks."""
  if cp == 1:
    return batch
  tokens = batch['tokens']
  b, s = tokens.shape
  out = dict(batch)
  if out.get('position_ids') is None:     # the model's default, made explicit before slicing
    out['position_ids'] = torch.arange(s, device=tokens.device).expand(b, s)
  order = ring_blocks.layout_indices(s, cp).to(tokens.device)
  mine = order[cp_rank]
  for key in ROW_KEYS:
    if out.get(key) is not None:
      out[key] = out[key][:, mine].contiguous()
  if batch.get('segment_ids') is not None:
    out['ring_segment_ids'] = batch['segment_ids'][:, order.flatten()].contiguous()
  return out


def with_ring(ops, mesh):
  """`ops` with the ring as attention (cp > 1): stage() asks it for each layer type's
  `layers.Attend`; unchanged at cp = 1."""
  if mesh.cp == 1:
    return ops
  ring = ring_attention.GroupRing(mesh.cp_group)

  def attend(batch, window, chunk):
    segments = batch.get('ring_segment_ids')

    def fn(q, k, v, scale, sinks):
      s = q.shape[2]
      with host_values.host():      # the layout's positions: the ring decides its blocks on the host
        index = ring_blocks.layout_indices(s * mesh.cp, mesh.cp)
      by_rank = segments.view(segments.shape[0], mesh.cp, s).transpose(0, 1) if segments is not None else None
      chunks = 2 * max(1, -(-s // (2 * PIECE)))     # whole pieces of each of the rank's two chunks
      return ring_attention.ring_attention(q, k, v, ring, index, by_rank, window, scale, chunks, sinks, chunk)
    return layers.Attend(fn)

  def own_positions(mask_bs_):
    index = ring_blocks.layout_indices(mask_bs_.shape[1], mesh.cp)[mesh.cp_rank].to(mask_bs_.device)
    return mask_bs_[:, index]

  def whole_rows(x_bs_):
    parts = comm.all_gather(x_bs_, mesh.cp_group, 1, name='all_gather(whole rows over cp)')   # rank after rank
    order = ring_blocks.layout_indices(parts.shape[1], mesh.cp).flatten().to(x_bs_.device)
    return torch.empty_like(parts).index_copy_(1, order, parts)

  return dataclasses.replace(ops, context_attention=attend, context_size=mesh.cp, context_slice=own_positions,
                             whole_rows=whole_rows, row_sum=lambda x: comm.reduce_from_group(x, mesh.cp_group))


def check(config) -> list:
  """distributed_strategy.context_parallel_size against what the ring composes with."""
  problems, m, d = [], config.model, config.distributed_strategy
  cp, ring = d.context_parallel_size, m.fusions.ring_attention
  if not isinstance(ring, bool):
    problems.append(f'model.fusions.ring_attention={ring!r} must be True or False')
  if cp <= 1:
    return problems
  why = f'distributed_strategy.context_parallel_size={cp}'
  if not ring:
    problems.append(f'{why} needs model.fusions.ring_attention=True (the ring is the attention context '
                    'parallelism is built with); set it, or context_parallel_size=1')
  seq, tp = config.data.seq_length, d.tensor_model_parallel_size
  if seq % (2 * cp):
    problems.append(f'data.seq_length={seq} is not divisible by 2 x context_parallel_size = {2 * cp} (each rank '
                    f'holds two equal chunks); use a multiple of {2 * cp}')
  elif d.sequence_parallel and tp > 1 and (seq // cp) % tp:
    problems.append(f'data.seq_length / context_parallel_size = {seq // cp} is not divisible by '
                    f'tensor_model_parallel_size={tp} (needed by sequence_parallel)')
  if m.attention_dropout > 0:
    problems.append(f'model.attention_dropout={m.attention_dropout} with {why}: the ring never forms the '
                    'attention probabilities (it merges blocks by their log-sum-exp), so there is no '
                    'whole-row probability to drop; set model.attention_dropout=0 or context_parallel_size=1 '
                    '(hidden, ffn and LoRA dropout are exact under cp)')
  if m.get('rope_scaling') is not None and m.rope_scaling.type in ('dynamic', 'longrope'):
    problems.append(f"model.rope_scaling.type={m.rope_scaling.type!r} with {why}: its frequencies depend on the "
                    "longest position, which a slice does not see; use 'linear', 'llama3' or 'yarn', or "
                    "context_parallel_size=1")
  if m.compile:
    problems.append(f'model.compile=True with {why}: the ring is not traced; set model.compile=False')
  if m.moe.num_experts > 0 and not m.moe.dropless and m.moe.get('fixed_buffers'):
    problems.append(f'model.moe.fixed_buffers=True with model.moe.dropless=False and {why}: the buffers\' rows are '
                    'queue places in the slice, the capacity\'s are in the whole row; set fixed_buffers=False, '
                    'dropless=True or context_parallel_size=1')
  if m.moe.num_experts > 0 and m.get('objective', 'next_token') != 'next_token':
    problems.append(f'model.objective={m.objective!r} with MoE and {why}: a preference loss is taken once per '
                    'whole row, the auxiliary losses per slice; use context_parallel_size=1')
  if config.device == 'xla':
    problems.append(f"device='xla' with {why}: the ring's point-to-point sends are built for CPU/CUDA only")
  return problems


def warnings(config) -> list:
  d = config.distributed_strategy
  if config.model.fusions.ring_attention is True and d.context_parallel_size == 1:
    return ['model.fusions.ring_attention=True does nothing at distributed_strategy.context_parallel_size=1 (no '
            'ring to pass K/V around): attention is the usual one']
  return []
