"""ZeRO-1's collectives over row shards: gradients reduce-scattered to the rows each DP rank
owns, updated rows all-gathered back into the parameters (the update is optim/update.py).

A parameter box of R rows is split into `parts` shards of ceil(R / parts) rows (the last
ones padded), so each rank's optimizer state is a rectangle of the global array and
checkpoints stay layout-free. Both collectives go through flat buckets of whole shards;
with one part (no ZeRO-1) they are the identity and move no data.
"""
import math

import torch

from parallel import comm

BUCKET_BYTES = 32 * 2**20             # the default of `bucket_size_collectives` (MiB)


def shard_rows(rows, parts, index):
  """(rows [start, stop) of shard `index`, rows per shard) when `rows` are split into `parts`."""
  per = math.ceil(rows / parts)
  return slice(min(index * per, rows), min((index + 1) * per, rows)), per


def _row_size(tensor):
  return tensor.numel() // max(tensor.shape[0], 1)


def _pad_rows(tensor, rows):
  """[rows, row_size]: the tensor's rows flattened, zero-padded to `rows`."""
  flat = tensor.reshape(tensor.shape[0], -1)
  padded = torch.zeros(rows, flat.shape[1], dtype=flat.dtype, device=flat.device)
  padded[:flat.shape[0]] = flat
  return padded


def reduce_scatter_rows(gradients, owned, parts, group, bucket_bytes=BUCKET_BYTES):
  """name -> fp32 gradient of the rows this rank owns (`owned`: name -> (rows, per)), summed
  over `group`'s ranks, in flat buffers of about `bucket_bytes`."""
  if group is None:
    return {n: g if g.dtype == torch.float32 else g.float() for n, g in gradients.items()}
  out = {}
  sizes = {n: owned[n].per * _row_size(g) * 4 for n, g in gradients.items()}
  for bucket in comm.buckets(list(gradients), sizes, bucket_bytes):
    segments = [_pad_rows(gradients[n].float(), owned[n].per * parts).view(parts, -1) for n in bucket]
    flat = torch.cat(segments, dim=1)                   # [parts, per-rank bucket]
    mine = comm.reduce_scatter(flat.reshape(-1), group, 0, name='reduce_scatter(grads over dp, ZeRO-1)')
    offset = 0
    for n, seg in zip(bucket, segments):
      rows, per = owned[n]
      g = gradients[n]
      out[n] = mine[offset:offset + seg.shape[1]].view(per, -1)[:rows.stop - rows.start].view(
          (rows.stop - rows.start,) + tuple(g.shape[1:])).clone()
      offset += seg.shape[1]
  return out


def all_gather_rows(values, params, owned, parts, group, bucket_bytes=BUCKET_BYTES):
  """Write each rank's updated rows (`values`: name -> rows in the parameter dtype) into
  every rank's parameters."""
  with torch.no_grad():
    if group is None:
      for n, v in values.items():
        params[n].copy_(v)
      return
    sizes = {n: owned[n].per * _row_size(params[n]) * 4 for n in values}
    for bucket in comm.buckets(list(values), sizes, bucket_bytes):
      segments = [_pad_rows(values[n], owned[n].per).reshape(-1) for n in bucket]
      full = comm.all_gather(torch.cat(segments), group, 0,
                             name='all_gather(params over dp, ZeRO-1)').view(parts, -1)
      offset = 0
      for n, seg in zip(bucket, segments):
        p = params[n]
        rows = full[:, offset:offset + seg.numel()].reshape(-1, _row_size(p))
        p.copy_(rows[:p.shape[0]].view_as(p))
        offset += seg.numel()
