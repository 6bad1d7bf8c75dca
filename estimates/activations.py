"""Activation memory per transformer layer: the closed-form formula the memory estimate uses,
and the measurement that keeps it honest (tests/test_remat.py, tools/activation_memory.py)."""
import copy

import torch

from data import preference, sft
from model import attention as attention_fn, layers, lora, mla, moe, moe_dispatch, moe_kernels, param_table, transformer
from numerics import precision
from parallel import context, device as devices, mesh as meshes, remat, tensor


def activation_bytes_per_layer(config, bytes_per_value=4, tp=1, recompute=True) -> int:
  """Bytes one of our blocks keeps for backward on one rank, causal masking. Exact for our
  code on CPU: tests/test_remat.py pins it to `measured_bytes_per_layer`.

  N = s b tokens, h hidden, f ffn, a heads, g kv heads, d head dim, t TP; per rank
  a' = a/t, g' = max(g, t)/t, f' = f/t; σ = t under SP, else 1. w = bytes_per_value: 4
  (fp32), 2 for 16-bit parameters and so activations (autocast differs). Masks: 1 byte.

    norms (2)      rmsnorm 2 ((4 + w) Nh/σ + 4 N/σ)   x in fp32, 1/rms (fp32), x/rms
                   layernorm 2 w (Nh + 2 N)/σ          x, mean, 1/std
    linear inputs  2 w Nh/σ'      the norm outputs: under SP the column linears keep the rank's
                                  shard and gather it again in backward (parallel/sequence.py),
                                  σ' = t (a LoRA adapter's A does the same); the whole gathered
                                  input (σ' = 1) under autocast and with LoRA dropout
    attention      SDPA      w N (a' + 2g') d  q, k, v    + 4 b a' s  logsumexp (fp32)
                             + w N a' d  output  [+ w N a' d  o_proj's copy of it when q is
                             contiguous [b,a,s,d], i.e. after RoPE: SDPA keeps q's layout;
                             with one head per rank the [b,s,a d] view needs no copy]
                   explicit  w 3 N a' d  q, k, v repeated to a' heads + 4 b a' s^2 softmax
                             (fp32) [+ w b a' s^2  the probs matmul's input: dropped, or a
                             16-bit copy] + s^2 causal mask + w N a' d  o_proj input
    MLP            swiglu / geglu 4 w N f' (gate, up, act(gate), product) | gelu 2 w N f'
    (Gemma's q/k and sandwich norms are not counted: a few w Nh more per layer)
    dropout masks  2 Nh/σ residual + N f' ffn + b a' s^2 attention (*)

  Recompute keeps a region's inputs instead of its insides: selective 'attention' keeps
  w N (a' + 2g') d + w N a' d (q, k, v, and the output o_proj keeps anyway); 'mlp' keeps
  w Nh/σ in place of a linear input, the MLP terms and the ffn mask; 'norm' keeps w Nh/σ in
  place of a layernorm's terms; 'activation' keeps 3 w N f' of the gated MLP's 4 (not
  act(gate)); full keeps w Nh/σ.
  (*) Fixed layout artefacts: all_gather used to return a transposed view that each column
  linear copied (5 w Nh instead of 2 w Nh under SP), and own_chunk a view that kept the
  whole dropout mask; both now return their own storage.

  Context parallelism (c = context_parallel_size): s is the rank's slice, s/c, in every term
  (each rank keeps the activations of its tokens only), and attention is the ring (either
  attention setting): w N (2 a' + 2 g') d  q, k, v, its output + 4 b a' s  logsumexp (fp32)
  + w N a' d  o_proj's input; no s^2 term.

  Llama (fp32, SDPA, RoPE, no dropout, t = 1): 4 (11 Nh + 4 Nf) + 8 N + 4 b a s bytes,
  less 8 N (a - g) d with GQA; in 16-bit 47.5 sbh + 8 sb + 4 b a s for Llama-2 7B
  (f = 2.6875 h). Korthikanti's GPT block is 34 sbh + 5 a s^2 b; ours with the GPT options
  (layernorm, gelu, explicit attention, dropout) is 34 sbh + 7 a s^2 b + s^2 + 8 sb in
  16-bit: the same 34, plus an fp32 softmax, a per-layer causal mask, layernorm statistics.
  Under TP both are sbh (10 + 24/t) + ...; under SP both (34/t) sbh + ...: the column linears
  keep the shard and gather it again in backward, as Megatron's do.
  """
  m, a = config.model, config.data
  cp = config.distributed_strategy.get('context_parallel_size', 1)
  w, s, b, h = bytes_per_value, a.seq_length // cp, a.micro_batch_size, m.hidden_size   # s: this rank's slice
  n, d = s * b, transformer.head_dim(m)
  heads, kv = m.num_attention_heads // tp, max(param_table.kv_heads(m), tp) // tp   # per rank
  ffn = m.ffn_hidden_size // tp
  sp = tp > 1 and config.distributed_strategy.sequence_parallel
  local = n // tp if sp else n                 # residual-stream tokens on this rank
  # tokens of each linear input kept: the shard under SP, unless autocast or LoRA dropout keeps it whole
  peft = lora.settings(m)
  whole = precision.recipe(config.precision).autocast or (peft is not None and lora.option(peft, 'lora_dropout') > 0)
  gathered = local if sp and not whole else n
  granularity = m.activations_checkpoint_granularity if recompute else None   # recompute=False: as if off
  parts = tuple(m.activations_checkpoint_recompute) if granularity == 'selective' else ()
  if granularity == 'full':
    return w * local * h
  copies = False                               # (*) fixed: all_gather returns a contiguous tensor
  masked = local                               # (*) fixed: own_chunk clones its shard
  mask_heads = heads
  hidden_mask = masked * h if m.hidden_dropout > 0 else 0
  if 'norm' in parts:
    norm = w * local * h                       # its input
  elif m.normalization == 'rmsnorm':
    norm = (4 + w) * local * h + 4 * local     # rms_norm computes in fp32
  else:
    norm = w * (local * h + 2 * local)
  swiglu = m.activation in layers.GATED       # swiglu or geglu: gate, up, act(gate), product

  v_dim = m.mla.v_head_dim if mla.enabled(m) else d       # the values' (and the attention output's) head width
  attention = norm + w * gathered * h * (3 if copies else 1) + w * n * heads * v_dim + hidden_mask
  if mla.enabled(m) and 'attention' not in parts:
    kv = heads                                 # keys and values expanded per head
    attention += _latent_bytes(m, w, n)
  dropped = m.attention_dropout > 0
  if 'attention' in parts:
    attention += w * n * (heads + 2 * kv) * d
  elif cp > 1:                                 # the ring: q, k, v, its output, lse (fp32)
    attention += w * n * (2 * heads + 2 * kv) * d + 4 * b * heads * s
  elif fused_attention(config):
    copied = m.position_embedding_type == 'rope' and heads > 1   # one head: the rearrange is a view
    if mla.enabled(m):      # q and k joined from their parts; v a view of kv_b_proj's output (nope + v a head)
      attention += w * n * heads * (2 * d + m.mla.qk_nope_head_dim + v_dim) + 4 * b * heads * s
    else:
      attention += w * n * (heads * (1 + copied) + 2 * kv) * d + 4 * b * heads * s
    attention += w * mask_batch(config) * s * s if takes_mask(config) else 0   # SDPA's additive copy of the mask
  else:
    probs = (4 + (w if dropped or w != 4 else 0)) * b * heads * s * s
    attention += w * n * heads * (2 * d + v_dim) + probs + s * s + (b * mask_heads * s * s if dropped else 0)

  mlp = norm + hidden_mask
  if moe.enabled(m) and 'mlp' not in parts:
    mlp += moe_bytes(config, w, tp, b, n)
  elif moe.enabled(m):
    mlp += w * n * h                           # the region's input: the whole (gathered) sequence
  elif 'mlp' in parts:
    mlp += w * local * h
  else:
    inner = (3 if 'activation' in parts else 4) if swiglu else 2     # 'activation' drops act(gate)
    mlp += (w * gathered * h * ((2 if swiglu else 1) if copies else 1) + w * n * ffn * inner
            + (n * ffn if m.ffn_dropout > 0 else 0))
  return attention + mlp


def takes_mask(config) -> bool:
  """Whether attention takes a mask (model/attention.py): rows of several segments (SFT and
  preference rows, data.reset_attention_mask) or a sliding window; the ring (cp > 1) makes its own."""
  if config.distributed_strategy.get('context_parallel_size', 1) > 1:
    return False
  return segmented(config) or bool(config.model.get('sliding_window'))


def segmented(config) -> bool:
  """Whether micro batches carry segment_ids (data/sft.py rows, data.reset_attention_mask)."""
  return (config.model.objective in preference.OBJECTIVES or bool(sft.settings(config)['train_dir'])
          or bool(config.data.reset_attention_mask))


def mask_batch(config) -> int:
  """The mask's batch dim: per row with segments, else one for all."""
  return config.data.micro_batch_size if segmented(config) else 1


def mask_bytes_per_micro_batch(config) -> int:
  """The boolean mask [b or 1, 1, s, s] a micro batch's layers share (kept for backward, once
  per micro batch in flight), where attention takes one (`takes_mask`)."""
  s = config.data.seq_length
  return mask_batch(config) * s * s if takes_mask(config) else 0


def fused_attention(config) -> bool:
  """Whether attention runs as SDPA's fused kernels (no s x s probabilities kept): SDPA, but not
  latent attention on the CPU, whose kernels take values as wide as keys only (torch runs it on
  its math path, which keeps them)."""
  m = config.model
  return attention_fn.uses_sdpa(m) and not (mla.enabled(m) and devices.kind(config.device) == 'cpu')


def _latent_bytes(m, w, n) -> int:
  """Latent attention's tensors before the heads (model/mla.py), N = n tokens: the query
  bottleneck's output, its RMSNorm (fp32 input, 1 / rms, normed output) (4 + 2 w) N q_lora + 4 N;
  kv_a_proj's output w N (kv_lora + rope), the latent's norm 2 w N kv_lora + 4 N; the shared
  key's RoPE part w N rope."""
  a = m.mla
  q = (4 + 2 * w) * n * a.q_lora_rank + 4 * n if a.q_lora_rank else 0
  return q + w * n * (a.kv_lora_rank + a.qk_rope_head_dim) + 2 * w * n * a.kv_lora_rank + 4 * n + \
      w * n * a.qk_rope_head_dim


def moe_bytes(config, w, tp, b, n) -> int:
  """What a MoE feed-forward (model/moe.py) keeps for backward on one rank, no recompute: N = n
  tokens (the whole sequence: every TP rank routes all of them), E experts, k top_k, T = min(N k,
  b E C) kept slots (C the capacity; with EP, a rank's experts receive T on average), f' the
  expert width / t, w bytes per value:
    router input w N h; router logits and probabilities 8 N E (fp32), logsumexp 4 N, top-k
    indices and weights 12 N k + 4 N; slot indices 16 T (slot, token), their weights 4 T (and
    the grouped GEMM's offsets 4 E); the experts' sorted inputs and outputs 2 w T h, their
    inner 4 w T f'
    (gate, silu(gate), up, product; gpt-oss's clamped SwiGLU 7 w T f' and, with biases, each
    slot's expert 8 T and its down bias w N k h); under SP the router's own-gradient mask w s (and the
    shared gate's); Qwen2-MoE's shared expert 4 w N f_s' + w N h + w N (inner, output, gate).
  In fixed-size buffers (fixed_buffers: XLA, model.compile) of R rows per expert
  (moe_dispatch.buffer_rows): the slots' kept flags, rows and weights 9 N k + w N k, their inputs and
  weighted outputs 2 w N k h, the buffers w (E R + 1) h and the experts' inner 4 w E R f'.
  The estimate counts every layer as a MoE layer when the model has any."""
  m = config.model
  h, e, k = m.hidden_size, m.moe.num_experts, m.moe.top_k
  slots = min(n * k, b * e * moe_dispatch.capacity(m, n // b))
  f = moe.expert_ffn_size(m) // tp
  routing = w * n * h + 8 * n * e + 4 * n + 12 * n * k + 4 * n
  inner = 7 if m.moe.get('expert_activation') == 'clamped_swiglu' else 4   # gpt-oss's clamps: 3 more
  if fixed_buffers(config):
    rows = moe_dispatch.buffer_rows(m, b, n // b)
    experts = 9 * n * k + w * n * k * (2 * h + 1) + w * (e * rows + 1) * h + inner * w * e * rows * f
  else:
    dtype = torch.float32 if w == 4 else torch.bfloat16
    offsets = 4 * e if moe_kernels.grouped_mm_fits(h, f, dtype, devices.kind(config.device)) else 0
    experts = 20 * slots + offsets + w * slots * (2 * h + inner * f)
  if m.has_bias:          # gpt-oss: each slot's expert row (bias lookup), the down biases gathered per slot
    experts += 8 * slots + w * n * k * h + 4 * n * k
  sp = tp > 1 and config.distributed_strategy.sequence_parallel
  shared = m.moe.shared_expert_intermediate_size // tp
  masks = (2 if shared else 1) * w * (n // b) if sp else 0       # own-gradient masks: router, shared gate
  return routing + experts + masks + (w * n * (4 * shared + h + 1) if shared else 0)


def fixed_buffers(config) -> bool:
  """Whether the experts run in model/moe.py's fixed-size buffers (traced, or asked for)."""
  return bool(config.model.moe.get('fixed_buffers') or config.model.get('compile') or config.device == 'xla')


def measured_bytes_per_layer(config, mesh=None, dtype=torch.float32) -> int:
  """What autograd keeps for backward per layer on this rank, measured: the bytes of every
  distinct storage saved during the forward of a 2-layer model less those of a 1-layer one
  (so embedding, head and loss cancel), parameters excluded. Dropout is on when the config
  has any; recompute as configured. Under TP, call it on every rank of `mesh`."""
  return _saved_bytes(config, 2, mesh, dtype) - _saved_bytes(config, 1, mesh, dtype)


def _saved_bytes(config, num_layers, mesh, dtype):
  mesh = mesh or meshes.Mesh()
  m = copy.deepcopy(config.model)
  m.num_layers = num_layers
  ops, layer_fn = remat.setup(tensor.config_ops(config, mesh),
                              m.activations_checkpoint_granularity, m.activations_checkpoint_recompute)
  params = transformer.init(m, config.seed, dtype=dtype, tp=mesh.tp, boxes=tensor.boxes(m, mesh))
  b, s = config.data.micro_batch_size, config.data.seq_length
  tokens = torch.randint(0, m.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
  batch = {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:], 'loss_mask': torch.ones(b, s),
           'sample_ids': torch.arange(b)}
  batch = context.slice_batch(batch, mesh.cp, mesh.cp_rank)
  dropout_key = (config.seed, 'dropout') if layers.has_dropout(m) else None
  params_at = {p.untyped_storage().data_ptr() for p in params.values()}
  kept = {}  # storage address -> storage: views and re-saves count once; holding the storage
             # stops a freed one's address (a graph branch nobody uses) from being reused

  def pack(t):
    storage = t.untyped_storage()
    if storage.data_ptr() not in params_at:
      kept[storage.data_ptr()] = storage
    return t

  with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    transformer.stage(params, batch, m, ops, dropout_key=dropout_key, layer_fn=layer_fn)
  return sum(storage.nbytes() for storage in kept.values())
