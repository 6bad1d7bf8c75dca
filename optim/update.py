"""The parameter update: clip, step the optimizer over the rows this rank owns, round, share.

One path for every recipe and layout. Each trainable parameter box is split by rows (dim 0,
padded) into `parts` shards; this rank owns shard `index` (a `Rows` value). Without ZeRO-1
there is one part and a rank owns every row; with ZeRO-1 (`distributed_strategy.zero1`) the
parts are the DP ranks. For the rows it owns, a rank keeps the optimizer state and the rows
the optimizer steps (the "master"): an fp32 copy with master weights (mixed_precision), else
a view of the parameter itself, so no copy.
A step:
  1. gradients of the owned rows, summed over DP: views of the gradient buckets
     (parallel/grad_buffer.py), whose reductions the backward has already started;
  2. the global norm over them, clipping;
  3. optimizer.step() on the masters;
  4. masters rounded to the parameter dtype (nearest, or stochastically keyed by each
     element's global index, so every layout rounds alike: optim/rounding.py) and all-gathered
     back.
bf16SR keeps nothing in fp32 (NxD's: 2 bytes of parameter and 4 of moments per parameter): for
one update the owned rows and moments are widened to fp32 copies, then rounded back
(stochastically). Frozen parameters (not in `trainable`) get no gradient, state or rows.
"""
import typing

import torch

import host_values
from numerics import precision
from optim import balancing, matrices, optimizers, rounding, schedules, sr_update
from optim.update_state import CheckpointedState
from parallel import comm, experts, grad_buffer, grad_shards, grads as grad_ops, param_shards, tensor, zero


class Rows(typing.NamedTuple):
  """The rows of one parameter box this rank owns: `rows` of `per` (rows per part, padded)."""
  rows: slice
  per: int


def owned_rows(num_rows, parts, index) -> Rows:
  return Rows(*zero.shard_rows(num_rows, parts, index))


class Updater(CheckpointedState):

  def __init__(self, params, config, mesh, placement=None, trainable=None):
    """`placement`: name -> (box, global shape), where this rank's tensor sits in the global
    parameter (keys the stochastic rounding; default: the tensor is the whole parameter);
    `trainable`: names to update (default all), the rest are frozen."""
    self.params, self.mesh, self.config, self.layouts = params, mesh, config, tensor.layouts(config.model)
    self.recipe = precision.recipe(config.precision)
    # The cp ranks of a sequence saw parts of the same batch: gradients sum over dp x cp, and
    # ZeRO-1 shards over it (Megatron's distributed optimizer does the same).
    zero1 = config.distributed_strategy.zero1 and mesh.dp_cp_group is not None
    self.group = mesh.shard_group if zero1 else None        # HSDP: ZeRO's shard group
    self.bucket_bytes = int(config.bucket_size_collectives * 2**20)
    self.trainable = [n for n in params if trainable is None or n in trainable]
    for name, p in params.items():
      p.requires_grad_(name in self.trainable)
    self.placement = placement or {n: (tuple(slice(0, s) for s in p.shape), tuple(p.shape))
                                   for n, p in params.items()}
    strategy = config.distributed_strategy
    # ZeRO-1's in-place gathers left in flight after an update (name -> (work, group)), waited on
    # by wait_params: the next forward's layers, or anything else that reads the parameters.
    self.overlap_gather = bool(strategy.get('overlap_param_gather', True) and mesh.device.type != 'xla')
    self.pending = {}
    self.param_squares = None       # step(param_squares=True): this rank's owned rows' sum of squares
    # Gradients accumulate in the recipe's dtype in flat buckets, DP-reduced during the backward;
    # each domain (dense: DP, experts: expert DP) has its buckets, ZeRO-1 parts and group.
    self.zero1, self.domains = zero1, {}
    for n in self.trainable:
      self.domains.setdefault(experts.domain(mesh, n, zero1), []).append(n)
    # ZeRO-2 keeps only the owned part of each gradient between backward passes; ZeRO-3 the
    # parameters' too (params is a param_shards.ShardedParams: the update writes its shards)
    self.shards = param_shards.shards_of(params)
    sharded = strategy.get('zero_stage', 1) >= 2 and strategy.get('grad_reduce_per_micro_batch', True)
    self.grads = grad_buffer.Domains([
        (grad_shards.ShardedGradBuffer if sharded and parts > 1 else grad_buffer.GradBuffer)(
            params, names, self.recipe.grad_acc_dtype, parts, index, group, self.bucket_bytes,
            strategy.zero1_collectives, strategy.overlap_grad_reduce)
        for (group, parts, index), names in self.domains.items()])
    self.rows = {n: owned_rows(params[n].shape[0], parts, index)
                 for (_, parts, index), names in self.domains.items() for n in names}
    # Without a master copy the shard is a view of the parameter's rows.
    self.master = {n: self._owned(n).float() if self.has_master_copy(n) else self._owned(n)
                   for n in self.trainable}
    self.optimizer = optimizers.make_optimizer(self.master, config.model.optim, self.bucket_bytes,
                                               matrices.Matrices(self))
    self.fused = rounding.fusable(self)      # fixed by the optimizer, recipe, device and sizes: once
    self.narrowed_in_pass = rounding.narrowed_in_pass(self)

  def _owned(self, name):
    if self.shards is not None:
      return self.shards.shard[name]
    return self.params[name].detach()[self.rows[name].rows]

  def start(self, micro_batches):
    """A step of `micro_batches` backward passes begins: a bucket's DP reduction starts as soon
    as its parameters have had them all (distributed_strategy.overlap_grad_reduce)."""
    self.grads.start(micro_batches)

  def gradients(self):
    """name -> gradient of the rows this rank owns, summed over DP (views of the buckets); under
    HSDP the shard group's sums are then summed across the replicas, one all-reduce per bucket."""
    out = self.grads.reduced()
    if self.shards is not None:          # the step's passes are done: nothing stays gathered
      self.shards.free_all()
    for names, buf in zip(self.domains.values(), self.grads.buffers):
      replicas = experts.replicas(self.mesh, names[0], self.zero1)
      for part in buf.owned_parts() if replicas is not None else ():
        comm.all_reduce_(part, replicas, name='all_reduce(owned grads across HSDP replicas)')
    return out

  def lr(self, step):
    """The learning rate of optimizer step `step` (counted from 0) under model.optim.sched."""
    m = self.config.model
    return schedules.lr_at(step, m.optim.sched, m.optim.lr, self.config.trainer.max_steps, m.hidden_size)

  def wait_params(self, match=None):
    """Wait for the parameter gathers left in flight (distributed_strategy.overlap_param_gather)
    of the names `match(name)` accepts (None: all); until then their other ranks' rows are zeros."""
    for n in [n for n in self.pending if match is None or match(n)]:
      work, group = self.pending.pop(n)
      comm.wait(work, 'parameter gather over dp (ZeRO-1)', group)

  def balance(self, expert_loads, updated):
    """After the step: DeepSeek-V3's correction biases moved by the step's expert loads
    (optim/balancing.py; nothing without moe.load_balance_rate or where `updated` is False)."""
    balancing.update(self.params, expert_loads, self.config, self.mesh, updated)

  def step(self, gradients, lr, step, loss=None, defer_gather=False, param_squares=False):
    """Clip by the global norm and update, unless the norm (or `loss`) is not finite.
    Returns (grad norm, whether the update happened): the one host sync of a step on eager
    devices; on XLA a device bool (read on log steps). `defer_gather`: ZeRO-1's parameter
    gathers stay in flight (overlap_param_gather); the caller waits (wait_params). `param_squares`:
    the updated rows' sum of squares is taken before their gather, for param_norm."""
    for group in self.optimizer.param_groups:
      group['lr'] = lr
    # The one-pass update reads the gradients as they are (bf16SR's bf16) and applies the clip
    # coefficient itself (the same fp32 multiply): no fp32 copy of them, no pass to scale them;
    # on the CPU their norm is a compiled loop too for large tensors (one pass over the buckets,
    # where eager widens a copy and squares it into another).
    fused = self.fused
    owned = {n: g if g.dtype == torch.float32 or n in fused else g.float() for n, g in gradients.items()}
    norm, coefficient = self._clip(owned, fused)
    finite = torch.isfinite(norm) if loss is None else torch.isfinite(norm) & torch.isfinite(loss)
    if norm.device.type == 'xla':
      # No host sync inside a traced step: update, then keep the old values where the step
      # was not finite (a select in the graph). `ok` stays a device tensor.
      self._update(owned, step, keep_if_not=finite)
      ok = finite
    else:
      ok = host_values.flag(finite, 'the finite check of the loss and grad norm (assumed finite)', True)
      if ok:
        self._update(owned, step, fused=fused, scale=coefficient, squares=param_squares)
    self._clear()
    if not defer_gather:
      self.wait_params()
    return norm, ok

  def _clip(self, owned, fused):
    """grads.clip over every domain (each domain's boxes are disjoint over its own group), the
    names in `fused` left for the fused update to scale. Returns (norm, coefficient or None)."""
    max_norm = self.config.trainer.gradient_clip_val
    squares_of = sr_update.square_sum if fused else grad_ops.square_sum
    if self.mesh.ep == 1:
      return grad_ops.clip(owned, self.mesh, self.layouts, max_norm, extra_group=self.group, unscaled=fused,
                           squares_of=squares_of)
    norm = self._norm_by_group(owned, self.zero1, squares_of)
    coefficient = grad_ops.clip_coefficient(norm, max_norm)
    scaled = [g for n, g in owned.items() if n not in fused]
    if coefficient is not None and scaled:
      torch._foreach_mul_(scaled, coefficient)
    return norm, coefficient

  def _norm_by_group(self, tensors, zero1, squares_of=grad_ops.square_sum):
    """The global norm of `tensors` (name -> this rank's rows), each group of the names whose
    rows are disjoint over the same group (experts.norm_group) summed over it."""
    by_group = {}
    for n, t in tensors.items():
      by_group.setdefault(experts.norm_group(self.mesh, n, zero1), {})[n] = t
    return torch.stack([grad_ops.global_norm(part, self.mesh, self.layouts, group, squares_of) ** 2
                        for group, part in by_group.items()]).sum().sqrt()

  def param_norm(self, params):
    """The global L2 norm of `params` after the step; after step(param_squares=True) under ZeRO-1, from
    the owned rows' squares (taken before the gathers started) and the frozen ones: no wait."""
    squares, self.param_squares = self.param_squares, None
    if self.shards is not None:        # every parameter's owned rows, the frozen ones' too
      return self._norm_by_group(self.shards.shard, zero1=True)
    if squares is None:              # whole parameters; under EP each rank's experts are its own
      self.wait_params()
      return self._norm_by_group(params, zero1=False)
    return grad_ops.sharded_norm(squares, {n: t for n, t in params.items() if n not in self.master}, self.mesh,
                                 self.layouts, self.group)

  def _update(self, owned, step, keep_if_not=None, fused=frozenset(), scale=None, squares=False):
    if fused:
      self._fused_step(fused, owned, step, scale)
    narrow = rounding.widen(self, skip=fused)
    if keep_if_not is not None:
      before = {id(t): t.clone() for t in self._state_tensors()}
    for n, m in self.master.items():
      m.grad = None if n in fused else owned[n]      # the optimizer skips what is done
    self.optimizer.step()
    if keep_if_not is not None:
      with torch.no_grad():
        for t in self._state_tensors():      # state made by this step falls back to zeros
          old = before.get(id(t))
          t.copy_(torch.where(keep_if_not, t, old if old is not None else torch.zeros_like(t)))
    rounded = rounding.round_back(self, narrow, fused, step)
    if self.group is not None:
      rounded.update({n: m for n, m in self.master.items() if n not in rounded})
      if squares and self.overlap_gather and self.mesh.ep == 1:     # the rows the gathers are about to share
        self.param_squares = grad_ops.squares_total(rounded, self.mesh, self.layouts)
    if self.shards is not None:          # ZeRO-3: the next forward gathers them
      self.shards.write(rounded)
      return
    for names, buf in zip(self.domains.values(), self.grads.buffers):   # each domain's group and collective
      group = buf.group if buf.parts > 1 else None
      works = zero.gather_rows({n: v for n, v in rounded.items() if n in names}, self.params, names, buf.parts,
                               buf.index, group, buf.collective, self.bucket_bytes,
                               async_op=self.overlap_gather and zero.gathers_in_place(buf.collective, group))
      self.pending.update({n: (w, group) for n, w in works.items()})

  def _fusable(self):
    """The names the one pass steps (rounding.fusable), asked anew: self.fused is fixed at init."""
    return rounding.fusable(self)

  def _fused_step(self, names, owned, step, scale):
    """Rows (and moments) of `names` stepped in one pass each from the unscaled gradients
    `owned` times `scale` (the clip coefficient; None: 1); bf16 rows and moments rounded bit for
    bit keyed as rounding.round_all keys them; masters in narrowed_in_pass written to their parameters."""
    sr_update.adamw_step(self.optimizer, {n: self.master[n] for n in names}, owned,
                         {n: self._owned_box(n) for n in names},
                         {n: (self.config.seed, 'sr', step, n) for n in names}, scale=scale,
                         narrow={n: self.params[n].detach() for n in names & self.narrowed_in_pass})

  def _state_tensors(self):
    """Masters and every optimizer state tensor on the masters' device."""
    out = list(self.master.values())
    for state in self.optimizer.state.values():
      out += [v for v in state.values() if torch.is_tensor(v) and v.device == out[0].device]
    return out

  def _owned_box(self, name):
    """(box, global shape) of the rows of `name` this rank owns, within the global parameter."""
    box, shape = self.placement[name]
    owned = self.rows[name].rows
    return (slice(box[0].start + owned.start, box[0].start + owned.stop),) + tuple(box[1:]), shape

  def _clear(self):
    for n in self.trainable:
      self.params[n].grad = None
      self.master[n].grad = None
