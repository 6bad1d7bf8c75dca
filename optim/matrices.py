"""The whole matrices a matrix optimizer (Muon) orthogonalizes, under any layout.

The Updater steps the rows of each parameter box this rank owns (optim/update.py): its TP box,
cut into ZeRO's row shards. An update that needs a whole matrix gets it here and gives back
this rank's part:

  dense matrices [out, in]   each rank writes its owned rows at their place in a zero matrix of
                             the global shape, then the pieces are summed over the ZeRO shard
                             group and over TP (each piece counted once: a KV head's copies and a
                             TP-replicated box only from one rank, parallel/grads.py counts_once);
                             every rank of the gather gets the whole matrix
  expert stacks [e, f, h]    each of this rank's experts is its own matrix: ZeRO's rows are whole
                             experts and EP holds whole experts, so only TP's split of f is
                             gathered (over the TP group, as above)

PP stages hold whole layers: nothing crosses them. The sums are exact (one non-zero term an
element), so every layout orthogonalizes the same matrix as one device.
"""
import torch

from model import moe
from parallel import comm, grads, tensor


class Matrices:
  """`whole` / `part` for the parameters of an Updater (its placement, rows, domains and mesh)."""

  def __init__(self, updater):
    self.u = updater
    self.zero_group = {n: group if parts > 1 else None
                       for (group, parts, _), names in updater.domains.items() for n in names}

  def is_expert(self, name) -> bool:
    return moe.is_expert_param(name)

  def _tp_split(self, name) -> bool:
    mesh, layout = self.u.mesh, self.u.layouts[name]
    return mesh.tp > 1 and not tensor.is_tp_replicated(layout)

  def _target(self, name):
    """(the assembled tensor's shape, where this rank's rows sit in it)."""
    box, shape = self.u._owned_box(name)  # pylint: disable=protected-access
    if self.is_expert(name):              # this rank's experts, whole along the TP-split dims
      rows = box[0].stop - box[0].start
      return (rows,) + tuple(shape[1:]), (slice(0, rows),) + tuple(box[1:])
    return tuple(shape), tuple(box)

  def whole(self, name, rows):
    """The whole matrix (or this rank's experts' matrices) of which `rows` is this rank's part."""
    mesh = self.u.mesh
    shape, where = self._target(name)
    if not self._tp_split(name) and (self.is_expert(name) or self.zero_group[name] is None):
      return rows
    out = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
    if grads.counts_once(name, mesh, self.u.layouts[name]) or not self._tp_split(name):
      out[where] = rows
    if not self.is_expert(name):
      comm.all_reduce_(out, self.zero_group[name], name='all_reduce(whole matrix over ZeRO shards)')
    if self._tp_split(name):
      comm.all_reduce_(out, mesh.tp_group, name='all_reduce(whole matrix over tp)')
    return out

  def part(self, name, whole):
    """This rank's rows of `whole` (as `whole` assembled them)."""
    if whole.shape == self.u.master[name].shape:
      return whole
    return whole[self._target(name)[1]]

  def matrix_shape(self, name):
    """(rows, columns) of the matrix (of each expert's) a parameter is, in the global model."""
    shape = self.u.placement[name][1]
    return tuple(shape[-2:])
