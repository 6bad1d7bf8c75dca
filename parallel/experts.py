"""Expert parallelism (MoE): which experts a rank holds, the all-to-all token exchange, and
which ranks reduce (and ZeRO-shard) each parameter's gradients.

With expert_model_parallel_size = e, the ep group's rank r holds experts [r E/e, (r+1) E/e) of
every MoE layer: dim 0 of the stacked expert tensors (model/moe.py), a box like TP's, so
checkpoints stay layout-free. Routers are whole on every rank. Under TP each expert is split
over the TP group as well (model/moe.py); the ep group joins ranks of one TP rank, so tokens go
to the ranks holding the same TP slice of their experts.

A MoE layer under EP: each rank routes its own sequences (capacity per sequence: the same
drops at every layout), sorts its tokens by expert, then
  1. all-to-all of the per-expert counts, 2. all-to-all of the tokens to their experts' ranks,
  3. the local experts on the received tokens (regrouped by expert), 4. all-to-all back.
The backward runs the same exchanges in reverse (comm.all_to_all). Traced (XLA, model.compile)
the layer exchanges fixed-size expert buffers instead: expert_buffers. An expert's gradient on a
rank then holds the tokens of its whole ep group; summing it over the expert_dp group (the DP
ranks holding the same experts) gives the global gradient. Dense gradients sum over all of DP.
"""
import torch

import host_values
from model import moe, moe_kernels
from parallel import comm


def ep_box(name, box, spec, mesh):
  """`box` narrowed to this rank's experts when `name` is a stacked expert tensor."""
  if mesh.ep == 1 or not moe.is_expert_param(name):
    return box
  per = spec.shape[0] // mesh.ep
  return (slice(mesh.ep_rank * per, (mesh.ep_rank + 1) * per),) + tuple(box[1:])


def domain(mesh, name, zero1):
  """(group that sums the gradient of `name` over data parallel, ZeRO-1 parts, this rank's
  part): dense parameters over DP x CP (under HSDP, ZeRO's shard group: `replicas` sums across
  the groups), expert tensors over the DP ranks holding the same experts (under context
  parallelism then across the cp ranks too: `replicas`)."""
  if mesh.ep > 1 and moe.is_expert_param(name):
    return (mesh.expert_dp_group, mesh.expert_dp, mesh.expert_dp_rank) if zero1 and mesh.expert_dp > 1 else \
        (mesh.expert_dp_group, 1, 0)
  if zero1 and mesh.shard_size > 1:
    return mesh.shard_group, mesh.shard_size, mesh.shard_rank
  return mesh.dp_cp_group, 1, 0


def replicas(mesh, name, zero1):
  """The group across which the owned rows of `name` are replicas (their gradient is summed over
  it after the domain's reduction), else None: HSDP's replicate group; for expert tensors under
  EP the cp group (the slices of a row send their tokens to the same experts)."""
  if mesh.ep > 1 and moe.is_expert_param(name):
    return mesh.cp_group if mesh.cp > 1 else None
  if zero1 and mesh.shard_size < mesh.dp_cp:
    return mesh.replicate_group if mesh.shard_size > 1 else None
  return None


def norm_group(mesh, name, zero1):
  """The group over which the boxes of `name` that ranks hold are disjoint (for global norms):
  ZeRO-1's DP shards (HSDP: the shard group); for experts also the ep group (all of DP under
  ZeRO-1)."""
  if mesh.ep > 1 and moe.is_expert_param(name):
    return mesh.dp_group if zero1 and mesh.expert_dp > 1 else mesh.ep_group
  return mesh.shard_group if zero1 and mesh.shard_size > 1 else None


def expert_ffn(group, ep):
  """Ops.expert_ffn over an ep group: tokens sorted by (global) expert go to the ranks holding
  their experts and come back in the same order."""

  def ffn(x_th, counts, experts: moe_kernels.Experts, gemms=None):
    local = experts.gate.shape[0]
    send_counts = torch.tensor(counts, dtype=torch.int64, device=x_th.device).view(ep, local)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts.view(-1), send_counts.view(-1), [local] * ep, [local] * ep, group,
                           'all_to_all(tokens per expert)')
    even = 'MoE: the tokens each EP rank sends and receives (as many as it routes: spread evenly)'
    send = host_values.read(send_counts, lambda c: c.sum(1).tolist(), even, lambda: host_values.balanced(sum(counts), ep))
    recv = host_values.read(recv_counts, lambda c: c.sum(1).tolist(), even, lambda: send)
    received = comm.all_to_all(x_th, group, send, recv, 'all_to_all(tokens to experts)')
    # received rows are ordered (source rank, expert): regroup them by expert, stably
    expert_of = torch.arange(local, device=x_th.device).repeat(ep).repeat_interleave(recv_counts.view(-1),
                                                                                      output_size=sum(recv))
    order = torch.sort(expert_of, stable=True).indices
    per_expert = host_values.read(recv_counts, lambda c: c.sum(0).tolist(), even,
                                  lambda: host_values.balanced(sum(recv), local))
    y = moe_kernels.local_expert_ffn(received[order], per_expert, experts, gemms)
    back = torch.zeros_like(y).index_copy(0, order, y)
    return comm.all_to_all(back, group, recv, send, 'all_to_all(tokens from experts)')

  return ffn


def expert_buffers(group, ep):
  """Ops.expert_buffers over an ep group (traced MoE: model/moe.py's fixed-size buffers): each
  rank sends every other rank the buffers of that rank's experts ([E/ep, R, h] each, one
  all-to-all of equal splits: no counts to exchange), runs its experts on the ep x R rows
  they received, and sends the outputs back the same way."""

  def ffn(buffers_erh, experts: moe_kernels.Experts, gemms=None):
    e, rows, h = buffers_erh.shape
    local = e // ep
    split = [local * rows] * ep
    received = comm.all_to_all(buffers_erh.reshape(e * rows, h), group, split, split, 'all_to_all(expert buffers)')
    # received: [source rank, local expert, R, h] -> each local expert's rows from every source
    mine = received.view(ep, local, rows, h).transpose(0, 1).reshape(local, ep * rows, h)
    out = moe_kernels.grouped_expert_ffn(mine, experts, gemms)
    back = out.view(local, ep, rows, h).transpose(0, 1).reshape(e * rows, h)
    return comm.all_to_all(back, group, split, split, 'all_to_all(expert buffers back)').view(e, rows, h)

  return ffn
