"""Gradient synchronization, global norms and clipping across the mesh.

After backward each rank holds gradients of its parameter boxes (or, under ZeRO-1, of the rows
it owns), summed over DP. `sync` makes them the gradients of the global loss:
  1. SP: replicated parameters applied to sequence shards (norms, row biases) saw only their
     shard's tokens, so their gradients are summed over TP (a Megatron-LM bug once forgot this);
     so are, at every layout, LoRA's replicated factors (A of q/k/v/gate/up, B of o/down) and
     Gemma 3's per-head q/k norms: each rank's gradient comes from its shard of the layer only;
  2. KV replicas: each copy of a KV head saw only its ranks' query heads: summed over the
     replicas;
  3. PP with tied embeddings: the first stage's embedding and the last stage's LM head are
     copies of one table: their gradients are summed over the two stages;
(The DP sum comes first, during the backward: parallel/grad_buffer.py. The loss is already
divided by the global token count, so a sum, not a mean, is the global gradient.)
Norms count every element of the global model once: TP-replicated boxes only on TP rank 0,
KV copies only on the first replica, the tied table only on the first stage, then one sum
over TP and PP.
"""
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel import comm, tensor

def _all_reduce_bucketed(tensors, group, name, bucket_bytes=32 * 2**20):
  """Sum `tensors` over `group` through flat buffers of about `bucket_bytes`."""
  if group is None or not tensors:
    return
  sizes = [t.numel() * t.element_size() for t in tensors]
  for indices in comm.buckets(range(len(tensors)), sizes, bucket_bytes):
    bucket = [tensors[i] for i in indices]
    flat = comm.all_reduce_(_flatten_dense_tensors(bucket), group, name=name)
    for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
      dst.copy_(src)


def sync(grads, mesh, layouts, sequence_parallel, tied_embeddings=False):
  """Sum `grads` (name -> gradient of this rank's box or owned rows) in place as described above
  (`layouts`: name -> its declared layout, tensor.layouts)."""
  partial = [g for n, g in grads.items() if tensor.is_tp_partial(layouts[n]) or
             (sequence_parallel and tensor.is_sequence_parallel_replicated(layouts[n]))]
  _all_reduce_bucketed(partial, mesh.tp_group, 'all_reduce(partial replicated grads over tp)')
  if mesh.kv_group is not None:
    _all_reduce_bucketed([g for n, g in grads.items() if tensor.is_kv(layouts[n])], mesh.kv_group,
                         'all_reduce(KV replica grads)')
  if tied_embeddings and mesh.embed_group is not None and 'embed_tokens.weight' in grads:
    comm.all_reduce_(grads['embed_tokens.weight'], mesh.embed_group, name='all_reduce(tied embedding grads)')


def counts_once(name, mesh, layout):
  """Whether this rank's box of `name` (of declared `layout`) is the one copy counted in global norms."""
  if name == 'embed_tokens.weight' and mesh.pp_rank != 0:
    return False
  if tensor.is_tp_replicated(layout):
    return mesh.tp_rank == 0
  if tensor.is_kv(layout):
    return mesh.tp_rank % mesh.kv_replicator == 0
  return True


SQUARE_PIECE = 1 << 20      # elements an eager sum of squares widens and squares at a time


def square_sum(t):
  """The fp32 sum of squares of `t`'s elements: eagerly in pieces of whole rows of about
  SQUARE_PIECE elements, each widened into one fp32 buffer and squared there, the pieces' sums
  summed, so a large tensor is not widened and squared whole on the CPU (a 32M-element bf16
  embedding: 250 MiB of fp32 temporaries a parameter norm, and as much again in heap holes);
  elsewhere (XLA fuses it, CUDA takes square_sums' multi-tensor norm) and traced (torch.compile:
  optim/sr_update.square_sum) in one expression."""
  t = t.detach()
  if t.numel() <= SQUARE_PIECE or t.dim() == 0 or t.device.type != 'cpu' or torch.compiler.is_compiling():
    return t.float().pow(2).sum()
  rows = max(1, SQUARE_PIECE // max(t.numel() // t.shape[0], 1))     # whole rows: no copy of a view
  buffer = torch.empty((min(rows, t.shape[0]),) + t.shape[1:], dtype=torch.float32, device=t.device)
  sums = []
  for piece in t.split(rows):
    work = buffer[:piece.shape[0]]
    sums.append(work.copy_(piece).square_().sum())
  return torch.stack(sums).sum()


def square_sums(tensors, squares_of=square_sum, multi_tensor=None):
  """The fp32 sum of squares of each of `tensors`: `squares_of` each, or (`multi_tensor`; by
  default on CUDA) through torch's multi-tensor norm: fp32 accumulators, one launch per run of
  tensors of a dtype, where one per tensor costs three launches and two fp32 temporaries (a
  1.1B model's 201 bf16 gradients: 603 launches and ~8 ms of GPU time on an H100). Not on the
  CPU, where it sums naively (1.6e-4 relative error on 4M fp32 elements); CUDA's tree sum
  does not. The square of an fp32 norm is within an ulp or two of the sum of squares."""
  if multi_tensor is None:
    multi_tensor = bool(tensors) and tensors[0].device.type == 'cuda'
  if not multi_tensor:
    return [squares_of(t) for t in tensors]
  by_dtype = {}
  for i, t in enumerate(tensors):
    by_dtype.setdefault(t.dtype, []).append(i)
  out = [None] * len(tensors)
  for indices in by_dtype.values():
    norms = torch._foreach_norm([tensors[i].detach() for i in indices], 2, dtype=torch.float32)  # pylint: disable=protected-access
    for i, norm in zip(indices, torch._foreach_mul(norms, norms)):  # pylint: disable=protected-access
      out[i] = norm
  return out


def global_norm(tensors_by_name, mesh, layouts, extra_group=None, squares_of=square_sum):
  """L2 norm of the global model's tensors, each element counted once (`extra_group`: a
  group over which the tensors are disjoint shards too, e.g. ZeRO-1's DP; `squares_of`: how a
  tensor's fp32 sum of squares is taken, but on CUDA: square_sums)."""
  total = over_tp_pp(squares_total(tensors_by_name, mesh, layouts, squares_of), mesh)
  return comm.all_reduce_(total, extra_group, name='all_reduce(norm over dp shards)').sqrt()


def over_tp_pp(total, mesh):
  total = comm.all_reduce_(total, mesh.tp_group, name='all_reduce(norm over tp)')
  return comm.all_reduce_(total, mesh.pp_group, name='all_reduce(norm over pp)')


def squares_total(tensors_by_name, mesh, layouts, squares_of=square_sum):
  """This rank's fp32 sum of squares of the tensors it counts in global norms (counts_once)."""
  mine = [t for n, t in tensors_by_name.items() if t is not None and counts_once(n, mesh, layouts[n])]
  return torch.stack(square_sums(mine, squares_of)).sum() if mine else torch.zeros((), device=mesh.device)


def sharded_norm(owned_squares, whole, mesh, layouts, group):
  """L2 norm of a model whose rows are shared out over `group` (`owned_squares`: this rank's rows'
  sum of squares, squares_total) beside tensors every member holds whole (`whole`: name -> tensor)."""
  total = comm.all_reduce_(owned_squares, group, name='all_reduce(norm over dp shards)')
  if whole:
    total = total + squares_total(whole, mesh, layouts)
  return over_tp_pp(total, mesh).sqrt()


def clip_coefficient(norm, max_norm):
  """The factor gradients of global norm `norm` are scaled by so it is at most `max_norm`
  (an fp32 0-dim tensor), or None where clipping is off (max_norm 0)."""
  return torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None


def clip(grads, mesh, layouts, max_norm, extra_group=None, unscaled=(), squares_of=square_sum):
  """Global norm of `grads` (name -> tensor; global_norm's `squares_of`); scaled in place so it is
  at most `max_norm` (0 = off), but for the names in `unscaled`, which the caller scales itself.
  Returns (norm, coefficient or None)."""
  norm = global_norm(grads, mesh, layouts, extra_group, squares_of)
  coefficient = clip_coefficient(norm, max_norm)
  scaled = [g for n, g in grads.items() if n not in unscaled]
  if coefficient is not None and scaled:
    torch._foreach_mul_(scaled, coefficient)
  return norm, coefficient
