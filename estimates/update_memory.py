"""The optimizer's share of the memory estimate (estimates/memory.py): how many state tensors
each optimizer keeps per parameter, and the update phase's transient bytes beyond gradients and
state, which hang on which path optim/update.py takes (a compiled one-pass Adam(W) of
optim/sr_update.py, torch's fused or foreach kernels, eager stochastic rounding of widened rows
and moments, ZeRO-1's parameter gathers through a bucket). Kept apart because that choice of
path is the update's, and the rest of the estimate (parameters, gradients, activations) does
not depend on it; the bucket sizes are shared with the gradient reduction's estimate."""
import math

import torch

from model import lora, moe, param_table
from numerics import precision
from optim import optimizers
from parallel import comm, device as devices, grad_reduce, zero


def states(config, sizes=None) -> float:
  """State tensors per trained element: the mean over the trained elements of `sizes` (name ->
  elements; default the whole model) of what the optimizer keeps for each (optim/optimizers.py:
  Adam 2, Lion 1, Muon 1 on the layers' matrices and 2 elsewhere)."""
  specs = param_table.param_specs(config.model)
  sizes = sizes or {n: math.prod(s.shape) for n, s in specs.items()}
  trained = list(lora.trainable(config.model, sizes))
  total = sum(sizes[n] for n in trained)
  name = config.model.optim.name
  return sum(sizes[n] * optimizers.state_count(name, n, len(specs[n].shape)) for n in trained) / max(total, 1)


def bucket_bytes(config):
  return int(config.bucket_size_collectives * 2**20)


def largest_bucket(sizes_bytes, limit):
  """Bytes of the largest bucket comm.buckets cuts from `sizes_bytes` (a list, in order)."""
  return max((sum(sizes_bytes[i] for i in b) for b in comm.buckets(range(len(sizes_bytes)), sizes_bytes, limit)),
             default=0)


FUSED = ('adamw', 'adamw_fp32OptState', 'adam', 'sgd', 'adagrad')   # fused on CUDA: no temporaries
ADAM = ('adam', 'adamw', 'adamw_fp32OptState')     # what optim/sr_update.py's one pass steps


def update_temporaries(config, sizes, dp=1) -> int:
  """The update's transient bytes beyond gradients and state, over this rank's owned rows
  (ZeRO-1: 1/dp of each tensor's), the largest of
    the optimizer's: on XLA torch steps one tensor at a time (its foreach kernels are CUDA's):
      sqrt(v) and the quotient, 2 x 4 bytes x the largest tensor (measured); on CPU so do other
      optimizers, while Adam(W) on the fp32 rows (fp32 parameters, masters) of parameters of
      precision.FUSED_FP32_MIN_NUMEL elements or more is optim/sr_update.py's one compiled
      pass per tensor, in place (nothing); on CUDA
      the fused optimizers none, the others foreach over runs of at most
      bucket_size_collectives (optim/optimizers.chunks): 2 x the largest run
    the clip's norm: one tensor's fp32 square (of 16-bit gradients: and their fp32 copy); with
      the one pass, compiled (nothing) for tensors of FUSED_FP32_MIN_NUMEL elements or more; on
      CUDA torch's multi-tensor norm (grads.square_sums: nothing)
  16-bit gradients (bf16SR) are stepped from an fp32 copy of all owned rows (4 bytes each).
  For 16-bit parameters without masters (bf16SR) under Adam(W) on CPU and CUDA
  (precision.FUSED_SR_DEVICES), optim/sr_update.py steps and rounds each tensor in place in one
  compiled pass from the 16-bit gradients, after a norm compiled on CPU (nothing; eager for
  tensors under precision.FUSED_FP32_MIN_NUMEL elements: one tensor's fp32 copy and its
  square) or multi-tensor on CUDA (nothing). Elsewhere the step runs on fp32 working
  rows and moments (4 + 8 bytes per element, less the 4 of the bf16 moments freed as they
  widen), and then the larger of that plus the above, or that plus the
  rounded bf16 results held until all are rounded (6 bytes) plus the stochastic rounding of
  one bucket of rows and moments (~24 bytes per element: fp32 input, int32 noise, bits and
  clamps, the bf16 result, the hash; a bucket may pass bucket_size by one tensor). With
  ZeRO-1, the parameters' all-gather through one bucket (on gloo, point to point, and with
  `all_reduce`, a bitwise-OR all-reduce, each parameter is gathered in its own storage: nothing)."""
  recipe = precision.recipe(config.precision)
  shards = dp if config.distributed_strategy.zero1 and dp > 1 else 1
  trained = set(lora.trainable(config.model, sizes))
  owned = [math.ceil(v / shards) for n, v in sizes.items() if n in trained]
  if not owned:
    return 0
  fused = fused_fp32_names(config, sizes)
  cuda = devices.kind(config.device) == 'cuda'
  if not cuda:
    optimizer = 2 * 4 * max((math.ceil(v / shards) for n, v in sizes.items() if n in trained and n not in fused),
                            default=0)
  else:
    optimizer = 0 if config.model.optim.name in FUSED else 2 * largest_run(owned, bucket_bytes(config))
  grads32 = 4 * sum(owned) if recipe.grad_acc_dtype.itemsize != 4 else 0
  # with the one pass, the norm is compiled on CPU but for tensors too small to pay a call
  small = max((v for v in owned if v < precision.FUSED_FP32_MIN_NUMEL), default=0)
  norm = 0 if cuda else 4 * (small if fused else max(owned))
  temporaries = max(optimizer, norm) + grads32
  if fused_sr(config):       # it reads the 16-bit gradients
    temporaries = 0 if cuda else 2 * 4 * small
  elif recipe.param_dtype != torch.float32 and not recipe.has_master(recipe.param_dtype):
    moments = states(config, sizes)
    items = [4 * v for v in owned] * (1 + math.ceil(moments))   # rows, then each moment, as rounded
    bucket = largest_bucket(items, bucket_bytes(config)) // 4
    widened = 4 * (1 + moments) * sum(owned) - 2 * moments * sum(owned)
    rounded = 2 * (1 + moments) * sum(owned)
    temporaries = max(widened + temporaries, widened + grads32 + rounded + 24 * bucket)
  temporaries += muon_matrix_bytes(config, sizes)
  backend = devices.collective_backend(config)
  if shards > 1 and not zero.in_place_on(grad_reduce.resolved(config.distributed_strategy.zero1_collectives),
                                         backend):
    full = [v * recipe.param_dtype.itemsize for n, v in sizes.items() if n in trained]
    temporaries += largest_bucket(full, bucket_bytes(config))
  return int(temporaries)


def muon_matrix_bytes(config, sizes) -> int:
  """Muon's largest whole matrix and its iteration (optim/muon.py): the assembled fp32 momentum
  (the global matrix; a rank's experts whole over TP) and four of its size in the iteration's
  dtype (the iterate, the next one, the Gram matrix's product)."""
  if config.model.optim.name != 'muon':
    return 0
  specs, tp = param_table.param_specs(config.model), config.distributed_strategy.tensor_model_parallel_size
  wide = 2 if config.model.optim.muon.ns_dtype == 'bfloat16' else 4
  whole = [sizes[n] * tp if moe.is_expert_param(n) else math.prod(specs[n].shape)
           for n in lora.trainable(config.model, sizes) if param_table.is_hidden_matrix(n, len(specs[n].shape))]
  return (4 + 4 * wide) * max(whole, default=0)


def fused_sr(config) -> bool:
  """Whether bf16SR's update runs optim/sr_update.py's one compiled pass (Adam(W), SR without
  masters, a device type in precision.FUSED_SR_DEVICES)."""
  recipe = precision.recipe(config.precision)
  return (config.model.optim.name in ADAM and recipe.stochastic_rounding
          and not recipe.has_master(recipe.param_dtype) and devices.kind(config.device) in precision.FUSED_SR_DEVICES)


def fused_fp32(config) -> bool:
  """Whether Adam(W) steps fp32 rows (an fp32 recipe's parameters, or masters) in
  optim/sr_update.py's one compiled pass (on the CPU: precision.FUSED_FP32_DEVICES), for
  parameters of precision.FUSED_FP32_MIN_NUMEL elements or more."""
  recipe = precision.recipe(config.precision)
  fp32_rows = recipe.param_dtype == torch.float32 or recipe.has_master(recipe.param_dtype)
  return (config.model.optim.name in ADAM and fp32_rows
          and devices.kind(config.device) in precision.FUSED_FP32_DEVICES)


def fused_fp32_names(config, sizes) -> set:
  """The parameters whose fp32 rows fused_fp32 steps in the compiled pass: the trained ones of
  precision.FUSED_FP32_MIN_NUMEL elements or more (globally: `sizes` are estimate()'s, each a
  global size over tp x pp, and over ep for the experts)."""
  if not fused_fp32(config):
    return set()
  d = config.distributed_strategy
  spread = d.tensor_model_parallel_size * d.pipeline_model_parallel_size
  ep = d.get('expert_model_parallel_size', 1)
  return {n for n in lora.trainable(config.model, sizes)
          if sizes[n] * spread * (ep if moe.is_expert_param(n) else 1) >= precision.FUSED_FP32_MIN_NUMEL}


def largest_run(elements, limit) -> int:
  """fp32 bytes of the largest run optim/optimizers.chunks cuts from `elements` (tensors' sizes)."""
  return max((4 * sum(elements[i] for i in run) for run in optimizers.chunks(list(elements), limit)), default=0)
