"""One training step, and the parameters it updates on this rank: the public API the loop
(train.py), the benchmarks (tools/bench*.py) and the tests share.

    params = training.init_params(config, mesh)
    updater = update.Updater(params, config, mesh, training.placement(config, mesh))
    out = training.train_step(params, updater, micro_batches, config, i, mesh, tensor.config_ops(config, mesh))
"""
import math

import torch

from model import param_table, router_losses, transformer
from parallel import layer_stats as stats
from numerics import precision
from parallel import grads, param_shards, passes, pipeline, tensor


def train_step(params, updater, micro_batches, config, step, mesh, ops, reference=None, defer_param_gather=False,
               param_norm=False, layer_stats=False):
  """One optimizer step. Returns metrics as tensors (the finite check is the one host sync).
  `defer_param_gather`: ZeRO-1's gathers of the updated parameters are left in flight
  (distributed_strategy.overlap_param_gather) for the next step's forward to wait on layer by
  layer; the caller calls updater.wait_params() before it reads the parameters otherwise.
  `param_norm`: the step's parameter norm, read without waiting for those gathers
  (updater.param_norm); `layer_stats`: parallel/layer_stats.py's per-layer norms and loads."""
  updater.start(len(micro_batches))
  loss_sum, count, metric_sums = passes.forward_backward(params, micro_batches, config, mesh, ops, updater.recipe,
                                                  reference=reference, wait_params=updater.wait_params)
  updater.wait_params()            # the stage's forward waited for what it used; nothing stays behind
  gradients = updater.gradients()
  grads.sync(gradients, mesh, updater.layouts, config.distributed_strategy.sequence_parallel,
             config.model.share_embeddings_and_output_weights)
  lr = updater.lr(step)
  expert_loads = metric_sums.pop(router_losses.EXPERT_LOADS, None)
  loss, metrics = passes.global_loss(loss_sum, count, mesh, metric_sums)
  before_step = stats.gradient_norms(gradients, updater, config.model) if layer_stats else None   # before clipping
  grad_norm, updated = updater.step(gradients, lr, step, loss, defer_gather=defer_param_gather,
                                    param_squares=param_norm)
  updater.balance(expert_loads, updated)
  lazy = torch.is_tensor(updated)         # XLA: a device bool, read on log steps (_check_skips)
  if not lazy and not updated and config.trainer.nonfinite_policy == 'error':
    raise nonfinite_error(step, f' (loss={loss.item()}, grad_norm={grad_norm.item()})')
  out = {'loss': loss, 'grad_norm': grad_norm, 'lr': lr, 'skipped': ~updated if lazy else not updated,
         'metrics': metrics}
  if param_norm:
    out['param_norm'] = updater.param_norm(params)
  if layer_stats:
    out['layer_stats'] = {**before_step, **stats.after_step(params, updater, expert_loads, config.model)}
  return out


def nonfinite_error(step, values=''):
  return FloatingPointError(f'non-finite loss or gradient at step {step + 1}{values}; lower model.optim.lr, '
                            'check the data, or set trainer.nonfinite_policy=skip')


def param_boxes(config, mesh):
  """name -> this rank's box of each parameter of its pipeline stage."""
  return tensor.boxes(config.model, mesh, pipeline.config_owned_names(config, mesh))


def placement(config, mesh):
  """name -> (this rank's box, the global shape) of each parameter of its stage."""
  specs = param_table.param_specs(config.model, mesh.tp)
  return {n: (box, specs[n].shape) for n, box in param_boxes(config, mesh).items()}


def init_params(config, mesh, names=None):
  """This rank's boxes of its pipeline stage's parameters (slices of the single-device init),
  or of those among `names`. Under ZeRO-3 (zero_stage=3, over more than one DP rank) the
  model's parameters come sharded (parallel/param_shards.py)."""
  boxes = {n: b for n, b in param_boxes(config, mesh).items() if names is None or n in names}
  make = lambda boxes: transformer.init(config.model, config.seed, device=mesh.device, tp=mesh.tp,
                                        dtype=precision.recipe(config.precision).param_dtype, boxes=boxes)
  return param_shards.init(config, mesh, boxes, make) if names is None and shards_parameters(config, mesh) else \
      make(boxes)


def shards_parameters(config, mesh):
  """Whether the run's parameters are sharded (ZeRO-3 over more than one DP x CP rank)."""
  d = config.distributed_strategy
  return d.zero1 and d.get('zero_stage', 1) == 3 and mesh.dp_cp > 1


def local_sizes(config, mesh):
  """name -> elements of each parameter box this rank will hold (nothing allocated)."""
  return {n: math.prod(sl.stop - sl.start for sl in box) for n, box in param_boxes(config, mesh).items()}
