"""Memory estimate per rank, by component and phase, printed before training so a layout that
cannot fit fails early (the activation formula is estimates/activations.py)."""
import math

import torch

from estimates import activations
from estimates.host_heap import heap_holes_bytes
from model import lora, moe, objectives, transformer
from numerics import precision
from parallel import comm, device as devices, grad_buffer, zero

ADAM_STATES = {'adamw': 2, 'adamw_fp32OptState': 2, 'adam': 2, 'adamax': 2, 'novograd': 1,
               'adadelta': 2, 'adagrad': 1, 'rmsprop': 1, 'rprop': 2, 'sgd': 0, 'adafactor': 1}


def param_counts(config, sizes) -> dict:
  """{'params', 'trainable', 'adapters'}: element counts of `sizes` (name -> elements), of
  the trained parameters among them and of the LoRA adapters (fp32 whatever the recipe)."""
  trained = set(lora.trainable(config.model, sizes))
  return {'params': sum(sizes.values()), 'trainable': sum(v for n, v in sizes.items() if n in trained),
          'adapters': sum(v for n, v in sizes.items() if lora.is_adapter(n))}


PHASES = ('init', 'forward_backward', 'grad_reduction', 'update', 'checkpoint_save')
# CPU only: what the first step costs beyond tensors, measured (tools/bench_memory.py, torch
# 2.13, Linux): torch._dynamo and the modules the first optimizer imports (~70 MiB), kernel
# code paged in, autograd's and gloo's threads. CUDA's max_memory_allocated sees none of it.
RUNTIME_BYTES = {'init': 80 * 2**20, 'step': 90 * 2**20,
                 '16-bit': 12 * 2**20,       # + bf16 kernels' code
                 'inductor': 72 * 2**20}     # + torch._inductor and its compiled kernels (fused bf16SR, model.compile)


def even_share(elements, tp, pp, ep=1) -> dict:
  """name -> elements a rank holds of `elements` (name -> the global count, at the TP-padded
  vocabulary): 1/(tp pp) of each, and of MoE's experts 1/(tp pp ep) (split over TP like the
  dense MLP, 1/ep of them per rank: parallel/experts.py)."""
  return {n: v // (tp * pp * (ep if moe.is_expert_param(n) else 1)) for n, v in elements.items()}


def estimate(config, sizes=None, dp=1, pp_rank=0) -> dict:
  """Bytes per rank holding parameters of `sizes` (name -> elements; default: an even share
  of the model), by component and by phase. Components: params, grads (gradient_bytes),
  master weights and optimizer state (of the trained parameters only: a frozen LoRA base has
  none; ZeRO-1 divides both), activations of the micro batches in flight on stage `pp_rank`
  (1F1B: min(pp - pp_rank, micro batches): the first stage holds the most; of its s / cp
  tokens under context parallelism), logits (logits_bytes: a chunk's with
  model.fusions.chunked_cross_entropy), the optimizer's temporaries
  (update_temporaries), the gradient reduction's buffers (reduction_bytes), the checkpoint's
  host copy, the runtime (CPU: RUNTIME_BYTES), and DPO's frozen reference copy (none with
  LoRA, whose reference is the base itself, nor with precomputed reference log-probs).
  'phases' (phase -> bytes live at its peak, PHASES), 'peak_phase' and 'total' (its bytes)
  say when the rank peaks: what memory_check.check_fits compares with the rank's memory."""
  m, d = config.model, config.distributed_strategy
  tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
  recipe = precision.recipe(config.precision)
  if sizes is None:
    sizes = even_share({n: math.prod(spec.shape) for n, spec in transformer.param_specs(m, tp).items()},
                       tp, pp, d.get('expert_model_parallel_size', 1))
  n = param_counts(config, sizes)
  group = dp * d.get('context_parallel_size', 1)    # gradients reduce, and ZeRO-1 shards, over dp x cp
  shards = group if d.zero1 and group > 1 else 1
  param_bytes = recipe.param_dtype.itemsize
  base, trained_base = n['params'] - n['adapters'], n['trainable'] - n['adapters']
  microbatches = config.data.global_batch_size // (config.data.micro_batch_size * dp)
  in_flight = min(pp - pp_rank, microbatches)
  grads, grad_transient = gradient_bytes(config, sizes, group)
  out = {
      'params': base * param_bytes + n['adapters'] * 4,
      'grads': grads,
      'master': trained_base * 4 // shards if recipe.has_master(recipe.param_dtype) else 0,
      'optimizer': ((trained_base * recipe.state_dtype(recipe.param_dtype).itemsize + n['adapters'] * 4)
                    * ADAM_STATES.get(m.optim.name, 2) // shards),
      'activations': (math.ceil(m.num_layers / pp) * in_flight
                      * activations.activation_bytes_per_layer(config, param_bytes, tp)),
      'logits': logits_bytes(config, tp) if _holds_head(config, sizes) else 0,
      'grad_transient': grad_transient + fp8_transient_bytes(config, tp),
      'reduction': reduction_bytes(config, sizes, group),
      'update_temporaries': update_temporaries(config, sizes, group),
      'checkpoint_copy': checkpoint_copy_bytes(config, sizes, group),
      'runtime': (RUNTIME_BYTES['step'] + (RUNTIME_BYTES['16-bit'] if param_bytes == 2 else 0)
                  + (RUNTIME_BYTES['inductor'] if m.get('compile') or fused_sr(config) or fused_fp32_names(config, sizes)
                     else 0)
                  if devices.kind(config.device) == 'cpu' else 0),
  }
  if m.objective == 'dpo' and not config.model_alignment_strategy.dpo.precompute_ref_log_probs:
    part = objectives.reference_copy(config)   # DPO's frozen copy of the starting model or adapters
    if part != 'none':
      out['reference'] = out['params'] if part == 'model' else n['adapters'] * 4
  out['heap_holes'] = heap_holes_bytes(config, out['activations'] + out['logits'] + out['grad_transient'],
                                       devices.trim_setting(config) is True)
  return _with_phases(out)


def with_heap_trimmed(config, est) -> dict:
  """`est` for a run whose kept heap is trimmed near its estimate (memory_check.heap_trim): its
  holes counted at HEAP_HOLES instead of HEAP_HOLES_KEPT."""
  out = dict(est, heap_holes=heap_holes_bytes(config, est['activations'] + est['logits'] + est['grad_transient'],
                                              trimmed=True))
  return _with_phases(out)


def on_another_device(est) -> dict:
  """`est` for a run planned for another machine's device (a dry run judged on trainer.plan_cluster):
  no CPU heap's holes there."""
  return _with_phases(dict(est, heap_holes=0))


def _with_phases(out) -> dict:
  """`out` (bytes by component) with the bytes live at each phase's peak, the peak phase and its total."""
  held = out['params'] + out['master'] + out.get('reference', 0)      # from init to the end
  steady = held + out['optimizer'] + out['runtime']                  # from the first update on
  phases = {
      'init': held + (RUNTIME_BYTES['init'] if out['runtime'] else 0),
      'forward_backward': (steady + out['grads'] + out['activations'] + out['logits'] + out['grad_transient']
                           + out['heap_holes']),
      'grad_reduction': steady + out['grads'] + out['reduction'],
      'update': steady + out['grads'] + out['update_temporaries'],
      'checkpoint_save': steady + out['checkpoint_copy'],
  }
  out['phases'] = phases
  out['peak_phase'] = max(PHASES, key=phases.get)
  out['total'] = phases[out['peak_phase']]
  return out


def fp8_transient_bytes(config, tp) -> int:
  """precision.fp8's largest GEMM's float8 copies (numerics/fp8.py; the 16-bit input and weight
  are saved as without FP8, and scales are a few bytes): forward the input and weight, backward
  the gradient with the weight or the input, and under `rowwise` the GEMM's fp32 product of the
  scales, as large as its output."""
  if not config.precision.get('fp8'):
    return 0
  m, a, d = config.model, config.data, config.distributed_strategy
  n = a.micro_batch_size * a.seq_length // d.get('context_parallel_size', 1)
  width = max(m.num_attention_heads * transformer.head_dim(m), m.ffn_hidden_size) // tp
  k, o = m.hidden_size, width                          # the widest linear, either way round
  post = 4 if config.precision.fp8 == 'rowwise' else 0
  return max(n * k + k * o, n * o + k * o + post * n * k, n * o + n * k + post * k * o)


def components(est) -> dict:
  """The byte components of an estimate (not 'phases', 'peak_phase', 'total')."""
  return {k: v for k, v in est.items() if k not in ('phases', 'peak_phase', 'total')}


def _holds_head(config, sizes):
  return 'lm_head.weight' in sizes or (config.model.share_embeddings_and_output_weights
                                       and config.distributed_strategy.pipeline_model_parallel_size == 1)


def logits_bytes(config, tp=1) -> int:
  """Bytes of the last stage's logits at the loss (kept apart: a chunked cross-entropy changes
  only this): with N = b s / cp tokens (this rank's slice) and V' = padded vocab / t, 8 N V': the fp32 log-probs
  cross-entropy keeps and the fp32 copy of 16-bit logits they are made from (freed after the
  forward: nothing saves it, nor the logits). model/cross_entropy.py's backward turns the
  log-probs into the gradient in place, so fp32 logits (no copy) need 4 N V' of the 8: counted
  alike, an upper bound there. With model.fusions.chunked_cross_entropy = c
  (model/chunked_ce.py), N is one chunk's c tokens."""
  m, a = config.model, config.data
  tokens = a.micro_batch_size * a.seq_length // config.distributed_strategy.get('context_parallel_size', 1)
  chunk = m.fusions.get('chunked_cross_entropy', 0)
  return (min(chunk, tokens) if chunk else tokens) * transformer.padded_vocab_size(m, tp) // tp * 8


def gradient_bytes(config, sizes, dp=1) -> tuple:
  """(gradient buffers, the transient during backward) in bytes, for the bucketed-buffer design:
  every trainable parameter's gradient accumulates into flat per-bucket buffers of the recipe's
  grad accumulation dtype (with ZeRO-1 each parameter's rows padded to a multiple of dp: at
  most dp - 1 rows each, not counted), and p.grad is freed once added in, so

    buffers   = sum over trainable p of numel(p) * bytes(grad acc dtype)
    transient = max over trainable p of numel(p) * bytes(param dtype)   (one p.grad)

  LoRA adapters are fp32 whatever the recipe. The same holds for the code before the buffers:
  p.grad (fp32, bf16SR) or the fp32 main grads (mixed precision) are the buffers, and adding
  a micro batch's gradient into them is the transient."""
  recipe = precision.recipe(config.precision)
  trained = set(lora.trainable(config.model, sizes))
  buffers = sum(v * (4 if lora.is_adapter(n) else recipe.grad_acc_dtype.itemsize)
                for n, v in sizes.items() if n in trained)
  transient = max((v * (4 if lora.is_adapter(n) else recipe.param_dtype.itemsize)
                   for n, v in sizes.items() if n in trained), default=0)
  return buffers, transient


def _bucket_bytes(config):
  return int(config.bucket_size_collectives * 2**20)


def _largest_bucket(sizes_bytes, limit):
  """Bytes of the largest bucket comm.buckets cuts from `sizes_bytes` (a list, in order)."""
  return max((sum(sizes_bytes[i] for i in b) for b in comm.buckets(range(len(sizes_bytes)), sizes_bytes, limit)),
             default=0)


def reduction_bytes(config, sizes, dp=1) -> int:
  """The DP gradient reduction's transient (parallel/grad_buffer.py). Buckets are reduced in
  place: an all-reduce (plain DP, and ZeRO-1's `all_reduce`) needs none. ZeRO-1's
  reduce-scatter (`auto`) on NCCL and XLA writes each bucket's own part to a 1/dp output until
  it is copied back (with overlap every bucket can be in flight: the gradients / dp); on gloo
  it is point to point, one bucket at a time, receiving the other ranks' copies of this rank's
  part: (dp - 1) / dp of the largest bucket."""
  d = config.distributed_strategy
  backend = 'gloo' if devices.kind(config.device) == 'cpu' else 'nccl'
  if dp == 1 or not d.zero1 or grad_buffer.resolved(d.zero1_collectives) == 'all_reduce':
    return 0
  recipe = precision.recipe(config.precision)
  trained = set(lora.trainable(config.model, sizes))
  grads = [v * recipe.grad_acc_dtype.itemsize for n, v in sizes.items() if n in trained]
  if backend == 'gloo':
    return _largest_bucket(grads, _bucket_bytes(config)) * (dp - 1) // dp
  return sum(grads) // dp if d.overlap_grad_reduce else _largest_bucket(grads, _bucket_bytes(config)) // dp


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
    optimizer = 0 if config.model.optim.name in FUSED else 2 * largest_run(owned, _bucket_bytes(config))
  grads32 = 4 * sum(owned) if recipe.grad_acc_dtype.itemsize != 4 else 0
  # with the one pass, the norm is compiled on CPU but for tensors too small to pay a call
  small = max((v for v in owned if v < precision.FUSED_FP32_MIN_NUMEL), default=0)
  norm = 0 if cuda else 4 * (small if fused else max(owned))
  temporaries = max(optimizer, norm) + grads32
  if fused_sr(config):       # it reads the 16-bit gradients
    temporaries = 0 if cuda else 2 * 4 * small
  elif recipe.param_dtype != torch.float32 and not recipe.has_master(recipe.param_dtype):
    moments = ADAM_STATES.get(config.model.optim.name, 2)
    items = [4 * v for v in owned] * (1 + moments)             # rows, then each moment, as rounded
    bucket = _largest_bucket(items, _bucket_bytes(config)) // 4
    widened = 4 * (1 + moments) * sum(owned) - 2 * moments * sum(owned)
    rounded = 2 * (1 + moments) * sum(owned)
    temporaries = max(widened + temporaries, widened + grads32 + rounded + 24 * bucket)
  backend = 'gloo' if devices.kind(config.device) == 'cpu' else 'nccl'
  if shards > 1 and not zero.in_place_on(grad_buffer.resolved(config.distributed_strategy.zero1_collectives),
                                         backend):
    full = [v * recipe.param_dtype.itemsize for n, v in sizes.items() if n in trained]
    temporaries += _largest_bucket(full, _bucket_bytes(config))
  return temporaries


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
  """fp32 bytes of the largest run optim/optimizers.chunks cuts from `elements` (consecutive
  tensors up to `limit` bytes, a larger one alone), without importing optim (which sits above)."""
  largest, size = 0, None
  for n in elements:
    size = size + 4 * n if size is not None and size + 4 * n <= limit else 4 * n
    largest = max(largest, size)
  return largest


def checkpoint_copy_bytes(config, sizes, dp=1) -> int:
  """The save's host copy: none when a CPU rank saves synchronously (tensorstore reads the
  tensors in place); with exp_manager.async_checkpointing a copy of what this rank writes
  (at most its parameters, masters and state)."""
  if not config.exp_manager.async_checkpointing and devices.kind(config.device) == 'cpu':
    return 0
  recipe = precision.recipe(config.precision)
  n = param_counts(config, sizes)
  shards = dp if config.distributed_strategy.zero1 and dp > 1 else 1
  state = n['trainable'] * (recipe.state_dtype(recipe.param_dtype).itemsize * ADAM_STATES.get(config.model.optim.name, 2)
                            + (4 if recipe.has_master(recipe.param_dtype) else 0)) // shards
  return n['params'] * recipe.param_dtype.itemsize + state


def state_bytes_per_param(est, sizes) -> float:
  """Bytes of parameters, gradients, masters and optimizer state per parameter held
  (fp32 16, mixed_precision 18, bf16SR 8 with Adam; ZeRO-1 divides masters and state)."""
  return sum(est[k] for k in ('params', 'grads', 'master', 'optimizer')) / max(1, sum(sizes.values()))


def human_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.1f} {unit}' if unit != 'B' else f'{int(n)} B'
    n /= 1024
  return str(n)
