"""Pipeline parallelism: which layers each stage owns, and one executor for any schedule.

A stage is a contiguous range of layers with global names (`layers.17...` lives on whichever
rank holds layer 17); no tracing, no module wrappers. With v virtual chunks, rank r holds
virtual stages r, r + p, ..., the schedules in `pipeline_schedule` say in which order it
runs forwards, backwards and point-to-point exchanges, and `run_schedule` executes them.
"""
import math

import torch
import torch.distributed as dist

from model import param_table
from parallel import pipeline_schedule as schedules


def stage_bounds(num_layers, pp, vp=1, cuts=()):
  """[(lo, hi)] layer range of each virtual stage: explicit `cuts`, or an even split with the
  remainder going to the later stages (NxD's auto partition: the last stage also runs the head)."""
  stages = pp * vp
  if cuts:
    edges = [0, *cuts, num_layers]
  else:
    base, extra = divmod(num_layers, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    edges = [sum(sizes[:s]) for s in range(stages + 1)]
  return [(edges[s], edges[s + 1]) for s in range(stages)]


def check(num_layers, strategy) -> list:
  """Whether `num_layers` layers split into distributed_strategy's pp x virtual stages
  (degrees already > 0): a layer per chunk, equal chunks when interleaved, valid cuts."""
  problems = []
  pp, vp = strategy.pipeline_model_parallel_size, strategy.virtual_pipeline_model_parallel_size
  if num_layers < pp * vp:
    problems.append(f'model.num_layers={num_layers} < pipeline_model_parallel_size x '
                    f'virtual_pipeline_model_parallel_size = {pp} x {vp}: every chunk needs a layer')
  elif vp > 1 and num_layers % (pp * vp):
    problems.append(f'model.num_layers={num_layers} is not divisible by pp x virtual = {pp * vp} '
                    '(interleaved schedules need equal chunks)')
  if strategy.pipeline_cuts:
    cuts = list(strategy.pipeline_cuts)
    if len(cuts) != pp * vp - 1 or cuts != sorted(set(cuts)) or not all(0 < x < num_layers for x in cuts):
      problems.append(f'distributed_strategy.pipeline_cuts={tuple(cuts)} must be pp x virtual - 1 = '
                      f'{pp * vp - 1} increasing layer indices in (0, {num_layers})')
  if vp > 1 and pp == 1:
    problems.append(f'distributed_strategy.virtual_pipeline_model_parallel_size={vp} needs '
                    'pipeline_model_parallel_size > 1 (interleaving splits a stage across PP ranks)')
  return problems


def config_bounds(config, pp):
  """stage_bounds for a config's model and distributed_strategy at PP degree `pp`."""
  d = config.distributed_strategy
  return stage_bounds(config.model.num_layers, pp, d.virtual_pipeline_model_parallel_size,
                      tuple(d.pipeline_cuts))


def config_owned_names(config, mesh):
  """owned_names for this rank under a config."""
  vp = config.distributed_strategy.virtual_pipeline_model_parallel_size
  return owned_names(config.model, mesh, config_bounds(config, mesh.pp), vp)


def virtual_stages(mesh, vp):
  """The virtual stages this rank runs, by local chunk."""
  return [c * mesh.pp + mesh.pp_rank for c in range(vp)]


def owned_names(model_cfg, mesh, bounds, vp):
  """Parameters this pipeline rank holds: its layers, the embedding on the first stage, the
  final norm and head on the last (and, tied, a copy of the embedding there too)."""
  mine = virtual_stages(mesh, vp)
  last = len(bounds) - 1
  layer_ids = {i for vs in mine for i in range(*bounds[vs])}
  names = []
  for name in param_table.param_specs(model_cfg):
    if name.startswith('layers.'):
      keep = int(name.split('.')[1]) in layer_ids
    elif name in ('embed_tokens.weight', 'embed_positions.weight'):
      keep = 0 in mine or (last in mine and name == 'embed_tokens.weight'
                           and model_cfg.share_embeddings_and_output_weights)
    else:                                    # final norm, lm_head
      keep = last in mine
    if keep:
      names.append(name)
  return names


# --- a stage's message: its activations, and what else the next stage needs ---------------


def message_numel(shape, carry_shape, dtype):
  """Elements of a message holding activations of `shape` and an fp32 carry of `carry_shape`
  in `dtype` (pack)."""
  return math.prod(shape) + math.prod(carry_shape) * (1 if dtype == torch.float32 else 2)


def pack(x, carry):
  """One flat tensor of x's dtype holding x and `carry` (fp32, e.g. MoE's loss sums). In a
  16-bit message the carry goes as two halves, hi + lo, so it crosses with ~16 significant
  bits rather than 8; its gradient comes back in the message's dtype, as the activations'."""
  if x.dtype == torch.float32:
    parts = [carry]
  else:
    hi = carry.to(x.dtype)
    parts = [hi, (carry - hi.float()).to(x.dtype)]
  return torch.cat([x.reshape(-1)] + [p.reshape(-1) for p in parts])


def unpack(message, shape, carry_shape):
  """(activations, fp32 carry): `pack`'s inverse, differentiable (views and casts)."""
  n, k = math.prod(shape), math.prod(carry_shape)
  carry = message[n:n + k].float()
  if message.dtype != torch.float32:
    carry = carry + message[n + k:n + 2 * k].float()
  return message[:n].view(shape), carry.view(carry_shape)


# --- the schedule's executor ---------------------------------------------------------------


def _peer(mesh, pp_rank):
  return mesh.rank_of(mesh.dp_rank, pp_rank, mesh.tp_rank, mesh.cp_rank)


class _InFlight:
  """Point-to-point operations posted and not yet waited on: a receive is waited on when its
  tensor is first needed, a send only at the end of the schedule, so a stage never waits on
  its own send and a receive overlaps whatever runs before its consumer."""

  def __init__(self, mesh):
    self.mesh, self.recvs, self.sends = mesh, {}, []

  def post(self, comm_action, outbox, inbox, buffers):
    ops, keys = [], []
    for op in comm_action.ops:
      key = (op.tensor, op.microbatch, op.chunk)
      if op.kind == 'send':
        ops.append(dist.P2POp(dist.isend, outbox.pop(key).contiguous(), _peer(self.mesh, op.peer)))
        keys.append(None)
      else:
        inbox[key] = buffers.take()
        ops.append(dist.P2POp(dist.irecv, inbox[key], _peer(self.mesh, op.peer)))
        keys.append(key)
    for key, request in zip(keys, self._call(comm_action.ops, dist.batch_isend_irecv, ops)):
      if key is None:
        self.sends.append((request, comm_action.ops))
      else:
        self.recvs[key] = (request, comm_action.ops)

  def received(self, inbox, key):
    """inbox[key], popped, once its receive has completed."""
    request, ops = self.recvs.pop(key)
    self._call(ops, request.wait)
    return inbox.pop(key)

  def finish(self):
    for request, ops in self.sends:
      self._call(ops, request.wait)
    self.sends = []

  def _call(self, ops, fn, *args):
    try:
      return fn(*args)
    except RuntimeError as e:
      raise RuntimeError(f'rank {self.mesh.rank}: pipeline exchange {ops} failed: {e}') from e


class _Buffers:
  """Receive buffers of one shape, reused: a buffer goes back once its backward has run."""

  def __init__(self, shape, dtype, device):
    self.shape, self.dtype, self.device, self.free = shape, dtype, device, []

  def take(self):
    return self.free.pop() if self.free else torch.empty(self.shape, dtype=self.dtype, device=self.device)

  def give(self, buffer):
    self.free.append(buffer.detach().requires_grad_(False))


def deallocate(output):
  """Drop a sent stage output's values, keep its autograd node (Megatron's
  deallocate_output_tensor): backward from it needs only its shape, so it becomes a view of
  one element at that shape."""
  if output.grad_fn is None:               # a leaf (an input passed through): nothing to free
    return
  output.data = torch.empty(1, dtype=output.dtype, device=output.device).expand(output.shape)


def run_schedule(schedule, stage_fn, mesh, vp, buffer_shape, dtype=torch.float32, deallocate_outputs=False):
  """Execute one rank's action list. `stage_fn(microbatch, chunk, x_or_None) -> tensor` runs
  a chunk (x is None on virtual stage 0); on the last virtual stage it returns the
  microbatch's scaled loss. `deallocate_outputs`: free each output's values once it is sent
  (distributed_strategy.deallocate_pipeline_outputs). Returns the number of forwards run."""
  last_stage = mesh.pp * vp - 1
  inbox, outbox, kept = {}, {}, {}
  buffers = _Buffers(buffer_shape, dtype, mesh.device)
  in_flight = _InFlight(mesh)
  forwards = 0
  for action in schedule:
    if isinstance(action, schedules.Comm):
      in_flight.post(action, outbox, inbox, buffers)
      if deallocate_outputs:
        for op in action.ops:
          if op.kind == 'send' and op.tensor == 'act':
            deallocate(kept[(op.microbatch, op.chunk)][1])
      continue
    i, c = action.microbatch, action.chunk
    vs = c * mesh.pp + mesh.pp_rank
    if action.kind == 'F':
      x = None if vs == 0 else in_flight.received(inbox, ('act', i, c)).requires_grad_()
      out = stage_fn(i, c, x)
      kept[(i, c)] = (x, out)
      if vs != last_stage:
        outbox[('act', i, c)] = out.detach()
      forwards += 1
    else:
      x, out = kept.pop((i, c))
      if vs == last_stage:
        out.backward()
      else:
        grad = in_flight.received(inbox, ('grad', i, c))
        torch.autograd.backward(out, grad_tensors=grad)
        buffers.give(grad)
      if vs != 0:
        outbox[('grad', i, c)] = x.grad
        x.grad = None
        buffers.give(x)
  in_flight.finish()
  assert not kept and not inbox and not outbox, 'schedule left work undone'
  return forwards


def run_forward_only(num_microbatches, stage_fn, mesh, vp, buffer_shape, dtype=torch.float32):
  """Evaluation: microbatches in order through every chunk, blocking send/recv. Items run in
  (microbatch, virtual stage) order on every rank, so the waits cannot form a cycle."""
  last_stage = mesh.pp * vp - 1
  for i in range(num_microbatches):
    for c in range(vp):
      vs = c * mesh.pp + mesh.pp_rank
      x = None
      if vs != 0:
        x = torch.empty(buffer_shape, dtype=dtype, device=mesh.device)
        dist.recv(x, _peer(mesh, (vs - 1) % mesh.pp))
      out = stage_fn(i, c, x)
      if vs != last_stage:
        dist.send(out.contiguous(), _peer(mesh, (vs + 1) % mesh.pp))
