"""ZeRO-3: the parameters sharded over data parallel like their gradients and optimizer state
(distributed_strategy.zero_stage=3).

Each rank keeps `shard[name]`: the rows of each parameter box it owns (zero.shard_rows: the
rows its optimizer state and gradient part cover). The box itself (`params[name]`, the tensor
the model reads and autograd accumulates into) keeps its shape, dtype and identity, but its
storage is freed (resized to 0 bytes) but while a unit of the model needs it:

  forward   unit i is gathered before it runs (every rank's rows into the box's storage) and
            unit i + 1's gather started (prefetch: it runs while i computes); after it, i's
            storage is freed (distributed_strategy.reshard_after_forward; else kept until
            the backward pass ends)
  backward  as unit i's backward starts (a hook on its output's gradient) i is gathered
            again and i - 1's gather started; units above i + 1 are done and freed; the
            pass's end frees everything (reshard_after_backward; else the step's end: the
            micro batches after the first gather nothing)

A unit is one layer's parameters. The embedding is one (gathered for the lookup, freed after
it: its backward reads only the token ids); the final norm and the head another (gathered
while the last layer runs, kept until the backward pass ends, whose first step it is). The
gradients are ZeRO-2's (parallel/grad_shards.py); the update writes the owned rows into
`shard`, and nothing is gathered after it.

Autograd's saved tensors keep referring to the box's storage, so a backward reads the bits
gathered again for it. The gathers write through `.data` (a version counter of its own), so
autograd does not take them for in-place changes. A freed box must not be read (its storage
is empty): what reads parameters outside a step goes through `shard` (checkpoints, norms).
"""
import math

import torch

from parallel import comm, experts, grad_reduce, zero

EMBEDDING = ('embed_tokens.weight', 'embed_positions.weight')


class ShardedParams(dict):
  """A ZeRO-3 run's parameters: name -> box (storage freed between uses), and `shards`, the
  ParamShards that holds each box's owned rows and gathers it."""
  shards = None


def unit_of(name):
  """'layers.<i>' for a layer's parameters, else 'embedding' or 'head' (final norm, lm_head)."""
  if name.startswith('layers.'):
    return '.'.join(name.split('.')[:2])
  return 'embedding' if name in EMBEDDING else 'head'


def init(config, mesh, boxes, make) -> ShardedParams:
  """A ZeRO-3 rank's parameters: `make(boxes)` (fresh leaves of the given boxes) is asked for the
  owned rows of each box only, and each box is an empty tensor of its shape (no rank ever holds
  the whole model); a box nobody shares rows of (experts at ep = dp) is made whole."""
  owned_boxes, parts_of = {}, {}
  for n, box in boxes.items():
    _, parts_of[n], index = experts.domain(mesh, n, True)
    rows, _ = zero.shard_rows(box[0].stop - box[0].start, parts_of[n], index)
    owned_boxes[n] = (slice(box[0].start + rows.start, box[0].start + rows.stop),) + tuple(box[1:])
  owned = make(owned_boxes)
  # each unit's boxes are views of one storage (FSDP's flat parameter): gathered and freed as one
  # block, which the next unit of the same size then reuses (freed boxes one by one left the kept
  # CPU heap full of holes), its boxes 64-byte aligned
  offsets, sizes = {}, {}
  for n, box in boxes.items():
    if parts_of[n] > 1:
      unit = unit_of(n)
      offsets[n] = sizes.get(unit, 0)
      nbytes = math.prod(sl.stop - sl.start for sl in box) * owned[n].element_size()
      sizes[unit] = offsets[n] + -(-nbytes // 64) * 64
  storages = {unit: torch.empty(size, dtype=torch.uint8, device=next(iter(owned.values())).device).untyped_storage()
              for unit, size in sizes.items()}
  params = ShardedParams()
  for n, box in boxes.items():
    p = owned[n]
    if parts_of[n] == 1:
      params[n] = p
      continue
    params[n] = torch.empty(0, dtype=p.dtype, device=p.device).set_(
        storages[unit_of(n)], offsets[n] // p.element_size(), tuple(sl.stop - sl.start for sl in box))
    params[n].requires_grad_(p.requires_grad)
  params.shards = ParamShards(params, config, mesh, {n: p.detach() for n, p in owned.items()})
  for storage in storages.values():
    storage.resize_(0)
  return params


class ParamShards:

  def __init__(self, params, config, mesh, owned):
    """`params`: the boxes (each unit's views of one storage, freed; the kept-whole ones apart);
    `owned`: name -> this rank's rows of each."""
    strategy = config.distributed_strategy
    self.params, self.mesh = params, mesh
    self.keep_after_forward = not strategy.get('reshard_after_forward', True)
    self.prefetch = strategy.get('overlap_param_gather', True)     # off: each unit gathered when it is needed
    # FSDP2's set_reshard_after_backward(False): under gradient accumulation the layers stay
    # gathered from their first pass to the step's end (Updater.gradients frees them)
    self.keep_after_backward = not strategy.get('reshard_after_backward', True)
    self.tied = config.model.share_embeddings_and_output_weights
    self.shard, self.rows, self.domain, self.units, self.members, self.nbytes = {}, {}, {}, {}, {}, {}
    self.collective = grad_reduce.resolved(strategy.zero1_collectives)
    self.bucket_bytes = int(config.bucket_size_collectives * 2**20)
    self.tags = {n: t for t, n in enumerate(params)}       # gathers in flight together: a tag each
    for n, p in params.items():
      group, parts, index = experts.domain(mesh, n, True)
      self.units.setdefault(unit_of(n), []).append(n)
      self.rows[n], _ = zero.shard_rows(p.shape[0], parts, index)
      self.shard[n] = owned[n]
      if parts > 1:                  # else nobody to share rows with (experts at ep = dp): kept whole
        self.domain[n] = (group, parts, index)
        self.members.setdefault(unit_of(n), []).append(n)
        self.nbytes[unit_of(n)] = p.untyped_storage().nbytes()
    if self.tied and 'embed_tokens.weight' in params:
      self.units['head'] = self.units.get('head', []) + ['embed_tokens.weight']
    self.resident, self.pending, self.queued = set(), {}, False
    self.on_resize = None         # f(storage) after a box's storage is gathered into or freed (a traced step counts it)

  def unit(self, key):
    return self.units.get(key, [])

  # --- gather and free -----------------------------------------------------------------

  def _homes(self, names):
    """The storage units (unit_of) holding the sharded ones of `names`, in order."""
    return list(dict.fromkeys(unit_of(n) for n in names if n in self.domain))

  def gather(self, names, wait=True):
    """Every rank's rows of `names` (all of each storage unit they are in) into their boxes,
    left in flight unless `wait` (a prefetch: skipped with overlap_param_gather off)."""
    if not (wait or self.prefetch):
      return
    units = [u for u in self._homes(names) if u not in self.resident]
    by_domain = {}
    for unit in units:
      self._resize(unit, self.nbytes[unit])
      for n in self.members[unit]:
        by_domain.setdefault(self.domain[n], []).append(n)
    for (group, parts, index), members in by_domain.items():
      in_place = zero.gathers_in_place(self.collective, group)
      works = zero.gather_rows({n: self.shard[n] for n in members}, {n: self.params[n].data for n in members},
                               members, parts, index, group, self.collective, self.bucket_bytes,
                               async_op=in_place and not wait, tags=self.tags)
      self.pending.update({n: (w, group) for n, w in works.items()})
    self.resident.update(units)
    if wait:
      self.wait(names)

  def wait(self, names):
    for n in [m for unit in self._homes(names) for m in self.members[unit]]:
      if n in self.pending:
        work, group = self.pending.pop(n)
        comm.wait(work, 'parameter gather over dp (ZeRO-3)', group)

  def free(self, names):
    """Free the storage units holding `names` (after their gathers in flight)."""
    units = [u for u in self._homes(names) if u in self.resident]
    self.wait([m for u in units for m in self.members[u]])
    for unit in units:
      self._resize(unit, 0)
      self.resident.discard(unit)

  def _resize(self, unit, nbytes):
    storage = self.params[self.members[unit][0]].untyped_storage()
    storage.resize_(nbytes)
    if self.on_resize is not None:
      self.on_resize(storage)

  def free_all(self):
    self.free([m for u in self.resident for m in self.members[u]])

  def write(self, rows):
    """The updated owned rows (name -> rows in the parameter dtype) into `shard`."""
    with torch.no_grad():
      for n, v in rows.items():
        if not self.shard[n].is_set_to(v):       # no master copy: the update wrote them already
          self.shard[n].copy_(v)

  # --- around a pipeline chunk's forward and its backward --------------------------------

  def before_chunk(self, lo, hi, first, last):
    """Before chunk [lo, hi)'s forward: the embedding (first chunk), layer lo's gather started,
    the head where there are no layers (last chunk)."""
    if first:
      self.gather(self.unit('embedding'))
    if lo < hi:
      self.gather(self.unit(f'layers.{lo}'), wait=False)
    elif last:
      self.gather(self.unit('head'))

  def after_chunk(self):
    """After a chunk's forward: without autograd (evaluation, reference passes) nothing stays."""
    if not torch.is_grad_enabled():
      self.free_all()

  def around_layers(self, layer_fn, lo, hi, first, last):
    """`layer_fn` wrapped: each layer i of [lo, hi) gathered before it runs, i + 1 (or, after
    the last, the head) prefetched, i freed after it; a hook on its output re-gathers it for
    its backward."""
    def run(fn, params, layer, *args):
      i = layer.index
      self.gather(self.unit(f'layers.{i}'))
      self.gather(self.unit(f'layers.{i + 1}') if i + 1 < hi else self.unit('head') if last else [], wait=False)
      if i == lo and first and not (last and self.tied):     # the lookup is done (a tied head still needs it)
        self.free(self.unit('embedding'))
      out = layer_fn(fn, params, layer, *args)
      training = torch.is_grad_enabled() and out.requires_grad
      if training:
        out.register_hook(self._before_backward(i, lo))
      if not (training and self.keep_after_forward):
        self.free(self.unit(f'layers.{i}'))
      if i == hi - 1 and last:
        self.gather(self.unit('head'))
      return out
    return run

  def _before_backward(self, i, lo):
    def hook(grad):
      if not self.queued:
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)  # pylint: disable=protected-access
      # layers above i + 1 have run their backward (i + 1's weight-only nodes may still be queued)
      if not self.keep_after_backward:
        self.free([n for u in self.resident if u.startswith('layers.') and int(u.split('.')[1]) > i + 1
                   for n in self.members[u]])
      self.gather(self.unit(f'layers.{i}'))
      if i > lo:
        self.gather(self.unit(f'layers.{i - 1}'), wait=False)
      return grad
    return hook

  def _end_of_pass(self):
    self.queued = False
    if not self.keep_after_backward:
      self.free_all()

  # --- what reads the parameters outside a step ------------------------------------------

  def bytes(self):
    """Bytes of the owned rows this rank keeps (the kept-whole boxes included)."""
    return sum(t.numel() * t.element_size() for t in self.shard.values())


def shards_of(params):
  """The ParamShards of a ZeRO-3 run's parameters, else None."""
  return getattr(params, 'shards', None)


def check(config) -> list:
  """What ZeRO-3 does not run with, each named with the fix."""
  d = config.distributed_strategy
  if not (d.zero1 and d.get('zero_stage', 1) == 3):
    return []
  from model import objectives      # pylint: disable=import-outside-toplevel  (objectives imports the model)
  problems = []
  refused = {
      'device=xla': (config.device == 'xla', 'torch-xla tensors have no storage to free between uses'),
      'model.compile=True': (config.model.compile, 'the compiled blocks are not traced with freed parameters'),
      f'model.objective={config.model.objective!r}': (objectives.for_config(config).reference is not None,
                                                      'its reference model is a second, whole copy of the weights'),
      'model_alignment_strategy.peft.merge_lora=True': (
          config.model_alignment_strategy.peft.lora_rank > 0 and config.model_alignment_strategy.peft.merge_lora,
          'merging needs whole base weights on a rank'),
  }
  for key, (hit, why) in refused.items():
    if hit:
      problems.append(f'distributed_strategy.zero_stage=3 with {key}: not built ({why}); use zero_stage=2, which '
                      'shards the gradients and optimizer state and keeps the parameters whole')
  return problems
