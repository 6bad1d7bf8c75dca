"""Memory estimate per rank, by component and phase, printed before training so a layout that
cannot fit fails early (the activation formula is estimates/activations.py, the optimizer's
state counts and the update's transients estimates/update_memory.py)."""
import math

from estimates import activations, grad_memory, param_memory, update_memory
from estimates.host_heap import heap_holes_bytes
from estimates.update_memory import fused_fp32_names, fused_sr, states, update_temporaries
from model import lora, moe, moe_dispatch, objectives, param_table, transformer
from numerics import precision
from parallel import device as devices

fused_fp32, largest_run = update_memory.fused_fp32, update_memory.largest_run   # importable here as before

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
  of the model), by component and by phase. Components: params (param_memory.param_bytes: under
  ZeRO-3 the owned rows, and 'gathered', the layers gathered whole during the passes), grads (grad_memory.gradient_bytes),
  master weights and optimizer state (of the trained parameters only: a frozen LoRA base has
  none; ZeRO-1 divides both), activations of the micro batches in flight on stage `pp_rank`
  (1F1B: min(pp - pp_rank, micro batches): the first stage holds the most; of its s / cp
  tokens under context parallelism), logits (logits_bytes: a chunk's with
  model.fusions.chunked_cross_entropy), the optimizer's temporaries
  (update_temporaries), the gradient reduction's buffers (grad_memory.reduction_bytes), the checkpoint's
  host copy, the runtime (CPU: RUNTIME_BYTES), and DPO's frozen reference copy (none with
  LoRA, whose reference is the base itself, nor with precomputed reference log-probs).
  'phases' (phase -> bytes live at its peak, PHASES), 'peak_phase' and 'total' (its bytes)
  say when the rank peaks: what memory_check.check_fits compares with the rank's memory."""
  m, d = config.model, config.distributed_strategy
  tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
  recipe = precision.recipe(config.precision)
  if sizes is None:
    sizes = even_share({n: math.prod(spec.shape) for n, spec in param_table.param_specs(m, tp).items()},
                       tp, pp, d.get('expert_model_parallel_size', 1))
  n = param_counts(config, sizes)
  group = param_memory.zero_parts(config, dp)     # ZeRO shards over dp x cp (HSDP: its shard groups)
  param_bytes = recipe.param_dtype.itemsize
  owned = owned_counts(config, sizes, dp)
  microbatches = config.data.global_batch_size // (config.data.micro_batch_size * dp)
  layers_in_flight, in_flight = layers_held(config, pp_rank, microbatches)
  per_layer = activations.activation_bytes_per_layer(config, param_bytes, tp)
  mask = activations.mask_bytes_per_micro_batch(config)
  grads, grad_transient = grad_memory.gradient_bytes(config, sizes, group)
  working = backward_working_bytes(config, tp)
  out = {
      'params': param_memory.param_bytes(config, sizes, dp)[0],
      'grads': grads,
      'master': owned['base'] * 4 if recipe.has_master(recipe.param_dtype) else 0,
      'optimizer': int((owned['base'] * recipe.state_dtype(recipe.param_dtype).itemsize + owned['adapters'] * 4)
                       * states(config, sizes)),
      'activations': layers_in_flight * per_layer + in_flight * mask,
      'logits': logits_bytes(config, tp) if _holds_head(config, sizes) else 0,
      'grad_transient': grad_transient + fp8_transient_bytes(config, tp) + working,
      'reduction': grad_memory.reduction_bytes(config, sizes, group),
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
  # overlap_grad_reduce: the reductions run during the last micro batch's backward, beside its
  # logits and backward working set (on the last stage, with one micro batch in flight, that is the
  # peak: seen tracing NxD's 405B file); its activations are freed as the buckets fill
  overlapped = d.overlap_grad_reduce and out['reduction'] > 0
  # the logits and their gradient are freed before the layers' backward starts: the larger of
  # them and a layer's backward working set is live, not both (seen tracing NxD's Llama-2 7B)
  out['logits_apart'] = min(out['logits'], working)
  out['gathered'] = param_memory.gathered_bytes(config, sizes, dp)
  out['reduction_overlap'] = out['logits'] + out['grad_transient'] - out['logits_apart'] if overlapped else 0
  return _with_phases(out)


def owned_counts(config, sizes, dp) -> dict:
  """{'base', 'adapters'}: trained elements whose masters and optimizer state this rank keeps.
  ZeRO-1 shards a dense parameter's over dp x cp (HSDP: its shard group) and an expert's over the DP ranks holding the
  same experts, dp / ep (parallel/experts.py's domains): at ep = dp the experts' are not
  sharded at all (seen tracing Mixtral at ep 8)."""
  trained = set(lora.trainable(config.model, sizes))
  out = {'base': 0, 'adapters': 0}
  for name, elements in sizes.items():
    if name in trained:
      out['adapters' if lora.is_adapter(name) else 'base'] += elements // param_memory.parts_of(config, name, dp)
  return out


def layers_held(config, pp_rank, microbatches) -> tuple:
  """(layers' activations stage `pp_rank` holds at its peak, micro batches they belong to): under
  1F1B min(pp - pp_rank, micro batches) micro batches of its L / pp layers; under the interleaved
  schedule (parallel/pipeline_schedule.py) its warm-up's 2 (pp - pp_rank - 1) + (vp - 1) pp
  chunks and one more, each L / (pp vp) layers (the last stage too holds vp - 1 rounds: seen
  tracing the planner's Mixtral layout)."""
  d, layers = config.distributed_strategy, config.model.num_layers
  pp, vp = d.pipeline_model_parallel_size, d.virtual_pipeline_model_parallel_size
  if vp == 1:
    in_flight = min(pp - pp_rank, microbatches)
    return in_flight * math.ceil(layers / pp), in_flight
  chunks = min(2 * (pp - pp_rank - 1) + (vp - 1) * pp + 1, microbatches * vp)
  return chunks * math.ceil(layers / (pp * vp)), min(microbatches, chunks)


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
      'forward_backward': (steady + out['grads'] + out.get('gathered', 0) + out['activations'] + out['logits']
                           + out['grad_transient']
                           - out.get('logits_apart', 0) + out['heap_holes']),
      'grad_reduction': steady + out['grads'] + out['reduction'] + out.get('reduction_overlap', 0),
      'update': steady + out['grads'] + out['update_temporaries'],
      'checkpoint_save': steady + out['checkpoint_copy'],
  }
  out['phases'] = phases
  out['peak_phase'] = max(PHASES, key=phases.get)
  out['total'] = phases[out['peak_phase']]
  return out


def backward_working_bytes(config, tp) -> int:
  """What a layer's backward holds beyond its saved activations (measured by tracing NxD's
  files at their layouts: step_trace.py): the gradient of the layer's input, and under
  sequence parallelism the input gathered again for the weight gradients beside it, w N h
  each (N = b s / cp tokens); with explicit attention (no SDPA, or attention dropout), the
  softmax's backward in fp32 beside the probabilities' gradient, 2 x 4 b a' s^2 (a' = heads / t),
  and 4 b a' s^2 more for the probabilities where recompute rebuilds them; under full recompute
  of a MoE layer its backward's fp32 slot gradients, 12 T h, beside the layer; with recompute, what recomputing one layer keeps beyond what was saved (Megatron's one layer),
  the larger of the two."""
  m, a, d = config.model, config.data, config.distributed_strategy
  cp = d.get('context_parallel_size', 1)
  w = precision.recipe(config.precision).param_dtype.itemsize
  s, b = a.seq_length // cp, a.micro_batch_size
  sp = tp > 1 and d.sequence_parallel
  granularity = m.activations_checkpoint_granularity
  rebuilt = granularity == 'full' or (granularity == 'selective' and 'attention' in m.activations_checkpoint_recompute)
  # the probabilities' gradient in fp32 and the softmax's backward output, and the probabilities
  # themselves where recompute rebuilds them (else they are a saved activation already)
  softmax = ((3 if rebuilt else 2) * 4 * b * (m.num_attention_heads // tp) * s * s
             if cp == 1 and not activations.fused_attention(config) else 0)
  recomputed = (activations.activation_bytes_per_layer(config, w, tp, recompute=False)
                - activations.activation_bytes_per_layer(config, w, tp)
                if granularity in ('full', 'selective') else 0)
  if granularity == 'full' and moe.enabled(m):
    # the MoE's backward right after the whole layer is recomputed: its fp32 copies of the slots'
    # gradients, 3 x 4 T h (seen tracing Mixtral at tp 8 x ep 8)
    n = b * s
    slots = min(n * m.moe.top_k, b * m.moe.num_experts * moe_dispatch.capacity(m, s))
    recomputed += 12 * slots * m.hidden_size
  # recompute rebuilds the attention core the softmax backward then replaces, and under full
  # recompute the rest of the layer is freed by then: the larger of the two is live (NxD's
  # Llama-2 7B and Megatron Llama-2 70B files)
  return (2 if sp else 1) * w * b * s * m.hidden_size + max(softmax, recomputed)


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
  """The byte components of an estimate (not 'phases', 'peak_phase', 'total', nor the parts of
  other components the phases need: 'reduction_overlap', what else the overlapped reduction
  meets, and 'logits_apart', the logits' bytes never live beside the backward working set)."""
  return {k: v for k, v in est.items() if k not in ('phases', 'peak_phase', 'total', 'reduction_overlap', 'logits_apart')}


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
  return (min(chunk, tokens) if chunk else tokens) * param_table.padded_vocab_size(m, tp) // tp * 8


def checkpoint_copy_bytes(config, sizes, dp=1) -> int:
  """The save's host copy: none when a CPU rank saves synchronously (tensorstore reads the
  tensors in place); with exp_manager.async_checkpointing a copy of what this rank writes
  (at most its parameters, masters and state)."""
  if not config.exp_manager.async_checkpointing and devices.kind(config.device) == 'cpu':
    return 0
  recipe = precision.recipe(config.precision)
  n = param_counts(config, sizes)
  shards = dp if config.distributed_strategy.zero1 and dp > 1 else 1
  state = int(n['trainable'] * (recipe.state_dtype(recipe.param_dtype).itemsize * states(config, sizes)
                                + (4 if recipe.has_master(recipe.param_dtype) else 0))) // shards
  params = n['params'] * recipe.param_dtype.itemsize
  return (params // shards if param_memory.sharded_params(config, dp) else params) + state


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
