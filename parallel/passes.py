"""Passes of the model over a rank's micro batches, through its pipeline stages: the training
pass (forward and backward under the pipeline schedule), evaluation, and forward-only passes
that return an objective's per-micro-batch output (DPO's reference log-probs).

Each micro batch's summed loss is divided by the objective's count (tokens, pairs) over the
whole global batch (summed over DP), so the accumulated gradient is the same for any micro
batch split and any DP degree: `grads.sync` then only has to add the ranks' gradients. The
loss and metric sums live on the last stage; `global_loss` gives every rank the means.
"""
import dataclasses

import torch

from model import layers, moe, objectives, router_losses, transformer
from numerics import precision
from parallel import comm, compiled, context, device as devices, param_shards, pipeline, pipeline_schedule, remat


def to_device(batch, device):
  return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _not_layer(name):
  return not name.startswith('layers.')


def _waiting(layer_fn, wait_params, hi):
  """layer_fn that first waits for layer i's parameter gathers (ZeRO-1's overlap_param_gather),
  and after the stage's last layer `hi - 1` for the rest (the final norm and the head)."""
  def run(fn, params, layer, *args):
    wait_params(lambda n: n.startswith(f'layers.{layer.index}.'))
    out = layer_fn(fn, params, layer, *args)
    if layer.index == hi - 1:
      wait_params(_not_layer)
    return out
  return run


def _releasing(layer_fn, hi):
  """layer_fn that offers the kept CPU heap's free pages back (parallel/device.py: past the
  start-up estimate they stop being resident) before each layer's forward, after the stage's
  last layer `hi - 1` (before the head's logits), and as each layer's backward starts."""
  def run(fn, params, layer, *args):
    devices.release_freed_host_memory()
    out = layer_fn(fn, params, layer, *args)
    if layer.index == hi - 1:
      devices.release_freed_host_memory()
    if out.requires_grad:
      out.register_hook(_release_in_backward)
    return out
  return run


def _release_in_backward(grad):
  devices.release_freed_host_memory()
  return grad


def model_batch(batch, mesh):
  """A micro batch as this rank's model sees it: on its device, cut to its cp slice."""
  return context.slice_batch(to_device(batch, mesh.device), mesh.cp, mesh.cp_rank)


def around_layers(layer_fn, wait_params, shards, trims_heap):
  """`chunk(lo, hi, first, last)` -> the layer_fn for layers [lo, hi) of one chunk: `layer_fn`
  (recompute, model.compile) inside what must happen around each layer, composed here once:
  the CPU heap's freed pages offered back (`trims_heap`), ZeRO-1's parameter gathers waited for
  (`wait_params(match)`, None: none in flight), ZeRO-3's layer gathered and freed (`shards`)."""

  def chunk(lo, hi, first, last):
    run_layer = _releasing(layer_fn, hi) if trims_heap else layer_fn
    if wait_params is not None:
      # the embedding first; the final norm and head after the last layer (all of it: no layers)
      wait_params(lambda n: _not_layer(n) and (lo == hi or n.startswith('embed_')))
      run_layer = _waiting(run_layer, wait_params, hi)
    if shards is not None:
      shards.before_chunk(lo, hi, first, last)
      run_layer = shards.around_layers(run_layer, lo, hi, first, last)
    return run_layer

  return chunk


def _run(params, batches, config, mesh, ops, recipe, objective, on_last, training=False, wait_params=None):
  """Run `batches` through this rank's chunks (`training`: the 1F1B / interleaved schedule, with
  dropout and the recompute policy; else forward only); the last stage's objective output of
  micro batch i goes to on_last(i, out), whose result is what backward starts from.
  `wait_params(match)`: waits for the named parameters' gathers still in flight, called before
  each is first read."""
  m = config.model
  dropout_key = (config.seed, 'dropout') if training and layers.has_dropout(m) else None
  ops, layer_fn = remat.setup(ops, m.activations_checkpoint_granularity,
                              m.activations_checkpoint_recompute) if training else (ops, None)
  vp = config.distributed_strategy.virtual_pipeline_model_parallel_size
  bounds = pipeline.config_bounds(config, mesh.pp)
  last = len(bounds) - 1
  layer_fn = compiled.layer_fn(m, mesh.device, layer_fn) or (lambda fn, *args: fn(*args))
  ops = compiled.loss_ops(m, ops)

  b = config.data.micro_batch_size
  act_shape = (b, config.data.seq_length // mesh.cp // ops.residual_slices, m.hidden_size)
  # MoE across stages: the auxiliary losses' sums travel with the activations (router_losses.Collector)
  carry_shape = (b, router_losses.carry_width(m)) if mesh.pp > 1 and moe.enabled(m) else None
  shards = param_shards.shards_of(params)      # ZeRO-3: each layer gathered around its passes
  around = around_layers(layer_fn, wait_params, shards, devices.trims_host_heap())

  def stage_fn(i, chunk, x):
    vs = chunk * mesh.pp + mesh.pp_rank
    carry = None
    if carry_shape is not None:
      x, carry = (None, torch.zeros(carry_shape, device=mesh.device)) if x is None else \
          pipeline.unpack(x, act_shape, carry_shape)
    run_layer = around(*bounds[vs], vs == 0, vs == last)
    with precision.compute_context(recipe, mesh.device.type):
      out = transformer.stage(params, batches[i], m, ops, layer_range=bounds[vs], x_bsh=x, last=vs == last,
                              layer_fn=run_layer, dropout_key=dropout_key, objective=objective, moe_carry=carry)
    if shards is not None:
      shards.after_chunk()
    if vs == last:
      return on_last(i, out)
    return out if carry is None else pipeline.pack(*out)

  shape = act_shape if carry_shape is None else (pipeline.message_numel(act_shape, carry_shape, recipe.param_dtype),)
  if training:
    schedule = pipeline_schedule.make_schedule(mesh.pp, len(batches), vp, mesh.pp_rank)
    pipeline.run_schedule(schedule, stage_fn, mesh, vp, shape, recipe.param_dtype,
                          config.distributed_strategy.deallocate_pipeline_outputs)
  else:
    pipeline.run_forward_only(len(batches), stage_fn, mesh, vp, shape, recipe.param_dtype)


@torch.no_grad()
def forward_outputs(params, batches, config, mesh, ops, objective, recipe):
  """`objective`'s first output for each micro batch on last-stage ranks (None on the others):
  a forward-only pass, e.g. [b, 2] reference log-probs."""
  out = [None] * len(batches)
  ops = dataclasses.replace(ops, moe_tally=None)     # a reference's routing is not this step's

  def keep(i, result):
    out[i] = result[0].detach()

  _run(params, batches, config, mesh, ops, recipe, objective, keep)
  return out


def forward_backward(params, micro_batches, config, mesh, ops, recipe=None, training=True, reference=None,
                     wait_params=None):
  """This rank's pass over the micro batches, accumulating grads of the objective's loss
  over the global batch (training); returns (this rank's loss sum, the global count, this
  rank's metric sums). `reference`: the reference model's params, for objectives that need
  one (DPO), unless the batches carry precomputed `ref_logps`. `wait_params`: see _run."""
  m = config.model
  objective = objectives.for_config(config)
  count = sum(objective.count(mb) for mb in micro_batches).to(mesh.device)
  extra = objective.extra_count and sum(objective.extra_count(mb) for mb in micro_batches).to(mesh.device)
  if extra is not None:       # one collective for both totals
    count, extra = comm.all_reduce_(torch.stack([count, extra]), mesh.dp_group,
                                    name='all_reduce(loss counts over dp)').unbind()
  else:
    count = comm.all_reduce_(count, mesh.dp_group, name='all_reduce(loss count over dp)')
  sums = {'loss': torch.zeros((), device=mesh.device)}
  tally = {} if moe.enabled(m) else None          # MoE routing metrics, summed over stages by global_loss
  ops = dataclasses.replace(ops, moe_tally=tally)
  batches = [model_batch(mb, mesh) for mb in micro_batches]
  if extra is not None:
    for batch in batches:
      batch.update(global_count=count, global_extra=extra)
  recipe = recipe or precision.recipe(config.precision)
  if objective.reference is not None and 'ref_logps' not in batches[0]:
    refs = forward_outputs(reference, batches, config, mesh, ops, objective.reference, recipe)
    for batch, ref in zip(batches, refs):
      batch['ref_logps'] = ref

  # whole-row objectives return the same loss on every cp rank: count it on one, or the
  # dp x cp sum of global_loss would count it cp times (the gradient needs every rank's backward)
  tallied = not (objective.whole_rows and mesh.cp_rank > 0)

  def accumulate(i, out):
    devices.release_freed_host_memory()     # after the head and the loss, before the backward
    loss, metrics = out
    for name, value in [('loss', loss)] + list(metrics.items()):
      if tallied:
        sums[name] = sums.get(name, 0) + value.detach()
    return loss / count

  _run(params, batches, config, mesh, ops, recipe, objective, accumulate, training, wait_params)
  loss_sum = sums.pop('loss')
  zero = torch.zeros((), device=mesh.device)
  metric_sums = {name: sums.get(name, zero) for name in objective.metrics}
  if tally is not None:
    metric_sums.update({name: torch.as_tensor(tally.get(name, zero)).detach() for name in router_losses.METRICS})
    if router_losses.EXPERT_LOADS in tally:      # per layer, for optim/balancing.py (train_step takes them out)
      metric_sums[router_losses.EXPERT_LOADS] = tally[router_losses.EXPERT_LOADS]
  return loss_sum, count, metric_sums


@torch.no_grad()
def evaluate(params, loader, config, mesh, ops, num_batches, reference=None):
  """(mean loss, {metric: mean}) over `num_batches` global batches of `loader` from its start,
  weighted by each batch's count (tokens or pairs)."""
  total, count, metrics = 0.0, 0.0, {}
  for i in range(num_batches):
    loss_sum, n, metric_sums = forward_backward(params, loader.global_batch(i * config.data.global_batch_size),
                                                config, mesh, ops, training=False, reference=reference)
    loss, means = global_loss(loss_sum, n, mesh, metric_sums)
    total += (loss * n).item()
    for name, value in means.items():
      metrics[name] = metrics.get(name, 0.0) + (value * n).item()
    count += n.item()
  count = max(count, 1.0)
  return total / count, {name: value / count for name, value in metrics.items()}


def global_loss(loss_sum, count, mesh, metric_sums=None):
  """The global batch's mean loss on every rank (only last-stage ranks hold loss sums), and
  with `metric_sums` (name -> this rank's sum) the global means of the metrics too."""
  names = list(metric_sums or {})
  sums = torch.stack([loss_sum] + [metric_sums[n] for n in names])
  sums = comm.all_reduce_(sums, mesh.pp_group, name='all_reduce(loss over pp)')
  # each cp rank holds its slice's sums; the count was taken over whole rows
  means = comm.all_reduce_(sums, mesh.dp_cp_group, name='all_reduce(loss over dp x cp)') / count
  return (means[0], dict(zip(names, means[1:]))) if metric_sums is not None else means[0]
