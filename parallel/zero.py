"""The parameter update: plain torch.optim, or ZeRO-1 / fp32 master weights over row shards.

`Updater` owns the optimizer and the precision recipe's bookkeeping. Two modes:
  direct  fp32 parameters, no ZeRO: torch.optim steps the parameters themselves.
  master  ZeRO-1 (`distributed_strategy.zero1`) and/or bf16 parameters: every parameter box
          is split by rows (dim 0, padded to a multiple of dp) over the DP group; each rank
          keeps an fp32 master of its rows and the optimizer state for them only. A step
          reduce-scatters the gradients (fp32) through flat buckets, updates the local rows,
          rounds them to the parameter dtype (nearest or stochastic) and all-gathers them.
Row shards keep each rank's optimizer state a rectangle of the global array, so checkpoints
stay layout-free. Without zero1 the same code runs with one shard (dp group of one).
bf16SR keeps no master precision: the fp32 rows are refreshed from the bf16 parameters
before each update, and the update is rounded stochastically into the parameter.
"""
import math

import torch

from optim import optimizers
from parallel import comm, grads as grad_ops, precision

BUCKET_BYTES = 32 * 2**20


def shard_rows(rows, parts, index):
  """Rows [start, stop) of shard `index` when `rows` are split into `parts` padded chunks."""
  per = math.ceil(rows / parts)
  return slice(min(index * per, rows), min((index + 1) * per, rows)), per


def _pad_rows(tensor, rows):
  """[rows, row_size]: the tensor's rows flattened, zero-padded to `rows`."""
  flat = tensor.reshape(tensor.shape[0], -1)
  padded = torch.zeros(rows, flat.shape[1], dtype=flat.dtype, device=flat.device)
  padded[:flat.shape[0]] = flat
  return padded


class Updater:

  def __init__(self, params, config, mesh):
    self.params, self.mesh, self.config = params, mesh, config
    self.recipe = precision.recipe(config.precision)
    zero1 = config.distributed_strategy.zero1
    self.group = mesh.dp_group if zero1 else None
    self.parts = mesh.dp if zero1 and mesh.dp_group is not None else 1
    self.index = mesh.dp_rank if self.parts > 1 else 0
    self.master_mode = zero1 or self.recipe.param_dtype != torch.float32
    self.accumulate_fp32 = (self.recipe.grad_acc_dtype == torch.float32
                            and self.recipe.param_dtype != torch.float32)
    self.main_grads = {}
    if self.accumulate_fp32:
      for name, p in params.items():
        p.register_post_accumulate_grad_hook(self._accumulate_hook(name))
    if self.master_mode:
      self.rows = {n: shard_rows(p.shape[0], self.parts, self.index) for n, p in params.items()}
      # fp32 parameters are their own master: the shard is a view of the parameter's rows.
      self.master = {n: p.detach()[self.rows[n][0]] if p.dtype == torch.float32 else
                     p.detach()[self.rows[n][0]].float() for n, p in params.items()}
      self.optimizer = optimizers.make_optimizer(self.master, config.model.optim)
    else:
      self.optimizer = optimizers.make_optimizer(params, config.model.optim)

  def _accumulate_hook(self, name):
    def hook(p):
      if name in self.main_grads:
        self.main_grads[name] += p.grad.float()
      else:
        self.main_grads[name] = p.grad.float()
      p.grad = None
    return hook

  @property
  def reduces_over_dp(self):
    """Whether `step` does the DP gradient reduction itself (reduce-scatter)."""
    return self.group is not None

  def gradients(self):
    """name -> accumulated gradient of this rank's parameter boxes (fp32 where the recipe says)."""
    if self.accumulate_fp32:
      return self.main_grads
    return {n: p.grad for n, p in self.params.items() if p.grad is not None}

  def state_bytes(self):
    """Bytes of optimizer state plus master weights held by this rank."""
    total = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    if self.master_mode:
      total += sum(t.numel() * t.element_size() for n, t in self.master.items()
                   if self.params[n].dtype != torch.float32)
    return total

  def step(self, gradients, lr, step):
    """Clip by the global norm and update. Returns (grad norm, whether the update happened)."""
    for group in self.optimizer.param_groups:
      group['lr'] = lr
    clip = self.config.trainer.gradient_clip_val
    if not self.master_mode:
      norm = grad_ops.clip(gradients, self.mesh, clip)
      ok = bool(torch.isfinite(norm))
      if ok:
        self.optimizer.step()
      self._clear()
      return norm, ok
    shard_grads = self._reduce_scatter(gradients)
    norm = grad_ops.clip(shard_grads, self.mesh, clip, extra_group=self.group)
    ok = bool(torch.isfinite(norm))
    if ok:
      if not self.recipe.master_weights and self.recipe.param_dtype != torch.float32:
        # bf16SR: the bf16 parameter is the only copy; the fp32 rows are scratch
        for n, p in self.params.items():
          self.master[n].copy_(p.detach()[self.rows[n][0]])
      for n, m in self.master.items():
        m.grad = shard_grads[n]
      self.optimizer.step()
      self._all_gather(step)
    self._clear()
    return norm, ok

  def _clear(self):
    self.main_grads = {}
    for p in self.params.values():
      p.grad = None
    if self.master_mode:
      for m in self.master.values():
        m.grad = None

  def _buckets(self):
    bucket, size = [], 0
    for n, p in self.params.items():
      bucket.append(n)
      size += self.rows[n][1] * (p.numel() // max(p.shape[0], 1)) * 4
      if size >= BUCKET_BYTES:
        yield bucket
        bucket, size = [], 0
    if bucket:
      yield bucket

  def _padded(self, name, tensor):
    """[parts, rows_per_shard * row_size]: the tensor's rows padded and cut per shard."""
    return _pad_rows(tensor, self.rows[name][1] * self.parts).view(self.parts, -1)

  def _unpad(self, name, flat_rows):
    """This shard's real rows from its padded segment, shaped like the parameter's rows."""
    rows = self.rows[name][0]
    p = self.params[name]
    return flat_rows.view(self.rows[name][1], -1)[:rows.stop - rows.start].view(
        (rows.stop - rows.start,) + tuple(p.shape[1:]))

  def _reduce_scatter(self, gradients):
    out = {}
    for bucket in self._buckets():
      segments = [self._padded(n, gradients[n].float()) for n in bucket]
      flat = torch.cat(segments, dim=1)                   # [parts, per-rank bucket]
      mine = flat[0] if self.group is None else comm.reduce_scatter(
          flat.reshape(-1), self.group, 0, name='reduce_scatter(grads over dp, ZeRO-1)')
      offset = 0
      for n, seg in zip(bucket, segments):
        out[n] = self._unpad(n, mine[offset:offset + seg.shape[1]]).clone()
        offset += seg.shape[1]
    return out

  def _rounded(self, name, step):
    m = self.master[name]
    if m.dtype == self.recipe.param_dtype:
      return m
    if self.recipe.stochastic_rounding:
      key = (self.config.seed, 'sr', step, name, self.rows[name][0].start)
      return precision.stochastic_round_keyed(m, *key)
    return m.to(self.recipe.param_dtype)

  def _all_gather(self, step):
    for bucket in self._buckets():
      segments = [_pad_rows(self._rounded(n, step), self.rows[n][1]).reshape(-1) for n in bucket]
      mine = torch.cat(segments)
      full = mine[None] if self.group is None else comm.all_gather(
          mine, self.group, 0, name='all_gather(params over dp, ZeRO-1)').view(self.parts, -1)
      offset = 0
      with torch.no_grad():
        for n, seg in zip(bucket, segments):
          p = self.params[n]
          rows = full[:, offset:offset + seg.numel()].reshape(-1, p.numel() // max(p.shape[0], 1))
          p.copy_(rows[:p.shape[0]].view_as(p))
          offset += seg.numel()
