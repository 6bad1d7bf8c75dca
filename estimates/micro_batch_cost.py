"""What one micro batch costs on one rank of a cluster (estimates/clusters.py), per layer, around
the layers and at the head: the pieces estimates/step_time.py assembles into a step.

A layer's forward and backward are GEMMs at matmul_eff of the compute dtype's peak + attention
at attn_eff + elementwise bytes / memory bandwidth + the TP/SP collectives (blocking: on the
critical path, except on XLA, where the backward's overlap the weight-gradient GEMMs); outside
the layers, the embedding's, the head input's and the loss's TP collectives; at the head, its
GEMM and the softmax over fp32 logits. Collectives cost what estimates/collective_cost.py says.

On `local` (tools/plan_calibrate.py measures it) the elementwise work runs at the rate the code's
passes reached (ew_bw) and the head's softmax at logit_s per logit, the framework's measured
overhead is added per layer and micro batch, per micro batch, per layer and per step, and each
blocking TP/SP collective waits sync_wait for the other rank beyond its measured curve.

Context parallelism (cp) divides every per-token cost by cp (a rank holds s / cp tokens of each
sequence; its causal attention share is 1/cp of the whole with the load-balanced chunks), runs
that attention as the ring does (fp32 matmuls at the fp32 peak plus its score blocks' bytes at
the memory bandwidth, where cp = 1 has a fused kernel at attn_eff), and adds the ring's
exchange: cp steps per layer, each step's K/V send overlapped with the current block's compute
(max of the two), backward the K/V and the fp32 dK/dV again; weight gradients reduce over
dp x cp. A MoE layer runs each token's top_k experts, split over TP like the dense MLP (and
the whole router on every TP rank), with the dense MLP's TP collectives; expert parallelism
(ep) adds 4 all-to-alls of the routed tokens per layer (dispatch and combine, forward and backward), not
overlapped; expert gradients reduce over the dp / ep ranks holding the same experts, dense
ones over dp x cp.
"""
from estimates.collective_cost import collective
from model import layers, moe, param_table, transformer
from numerics import precision


def compute_dtype(config) -> str:
  return 'fp32' if precision.recipe(config.precision).compute_dtype.itemsize == 4 else 'bf16'


def _ring(cluster, cp, tp, core, kv_bytes, grad_bytes):
  """(forward s, backward s) of ring attention's exposed exchange, one layer, one micro batch:
  cp steps of core / cp compute each, the next block's send started before the current
  block's compute (parallel/ring_attention.py), so each of the cp - 1 transfers costs what it
  exceeds its step's compute by. `core`: this rank's forward attention compute."""
  if cp == 1:
    return 0.0, 0.0
  send = lambda n: collective(cluster, 'p2p', n, cp, tp)     # pylint: disable=unnecessary-lambda-assignment
  step = core / cp
  fwd = (cp - 1) * max(0.0, send(kv_bytes) - step)
  # backward: each step's dK/dV leaves after its compute and is awaited a step later; the last
  # one (every block's total back to its owner) has nothing left to hide behind
  bwd = (cp - 1) * max(0.0, send(kv_bytes + grad_bytes) - 2 * step) + send(grad_bytes)
  return fwd, bwd


def _ring_score_bytes(b, s, heads, tp, cp):
  """Bytes ring attention's forward moves through its fp32 score blocks per rank and layer: the
  causal half of (s / cp) x s scores per head, about 6 elementwise passes (mask, max, subtract,
  exp, sum, rescale) each reading and writing 4 bytes (a count of parallel/ring_attention.py's
  ops, not a measurement)."""
  return b * heads / tp * s * s / (2 * cp) * 6 * 8


def elementwise_bytes(config, tp, cp=1, is_moe=False) -> tuple:
  """(attention sublayer, MLP sublayer) bytes of elementwise work, forward, one layer, one micro
  batch on one rank: the norm, residual add, RoPE and act x up passes, each read and written;
  under SP the norms and residuals hold s / tp tokens."""
  m, a, d = config.model, config.data, config.distributed_strategy
  n, h, hd = a.micro_batch_size * a.seq_length // cp, m.hidden_size, transformer.head_dim(m)
  heads, kv = m.num_attention_heads, param_table.kv_heads(m)
  ffn_act = (m.moe.top_k * moe.expert_ffn_size(m) + m.moe.shared_expert_intermediate_size if is_moe
             else m.ffn_hidden_size) / tp
  w = 4 if compute_dtype(config) == 'fp32' else 2
  local = n // tp if tp > 1 and d.sequence_parallel else n
  return (w * (local * h * (2 + 6) + 2 * n * (heads + kv) * hd / tp) + 8 * local * h,
          w * (local * h * (2 + 6) + 4 * n * ffn_act) + 8 * local * h)


def fp8_cast_bytes(config, tp, cp=1, ep=1, is_moe=False) -> tuple:
  """(forward, backward) bytes precision.fp8's scaling moves per layer and micro batch on one rank
  (numerics/fp8.py): each cast reads its 16-bit tensor twice (amax, then scale and cast) and
  writes 1 byte, 5 bytes per element; forward the input and weight of every linear, backward the
  gradient twice (one cast per GEMM) and the input and weight again (kept in 16 bits, cast anew).
  A MoE layer's experts read the routed tokens (top_k per token); its router and shared expert stay
  16-bit."""
  m, a = config.model, config.data
  n, h, hd = a.micro_batch_size * a.seq_length // cp, m.hidden_size, transformer.head_dim(m)
  heads, kv = m.num_attention_heads, param_table.kv_heads(m)
  dims = [(n, h, heads * hd / tp), (n, h, kv * hd / tp), (n, h, kv * hd / tp), (n, heads * hd / tp, h)]   # q k v o
  if is_moe:               # a rank's experts see the routed tokens, however EP spreads them
    f, experts = moe.expert_ffn_size(m) / tp, m.moe.num_experts // ep
    dims += [(n * m.moe.top_k / experts, h, f)] * 2 * experts + [(n * m.moe.top_k / experts, f, h)] * experts
  else:
    f = m.ffn_hidden_size / tp
    dims += [(n, h, f)] * (2 if m.activation in layers.GATED else 1) + [(n, f, h)]
  fwd = sum(5 * (t * k + k * o) for t, k, o in dims)
  bwd = sum(5 * (2 * t * o + t * k + k * o) for t, k, o in dims)
  return fwd, bwd


def _blocking(cluster, op, n, tp):
  """A TP/SP collective the code waits on: its cost, plus local's measured wait for the other
  rank (sync_wait; 0 on the datasheet clusters, and nothing where there is no TP)."""
  return collective(cluster, op, n, tp) + (cluster.sync_wait if tp > 1 else 0.0)


def layer_cost(config, cluster, tp, cp=1, ep=1, is_moe=False):
  """(forward s, backward s, {kind: (forward comm s, backward comm s)}) of one layer, one micro
  batch on one rank: kinds tp (TP/SP collectives), cp (ring exchange), ep (all-to-all)."""
  m, a, d = config.model, config.data, config.distributed_strategy
  b, s, h = a.micro_batch_size, a.seq_length, m.hidden_size
  n, hd = b * s // cp, transformer.head_dim(m)
  heads, kv, f = m.num_attention_heads, param_table.kv_heads(m), m.ffn_hidden_size
  gated = m.activation in layers.GATED
  w = 4 if compute_dtype(config) == 'fp32' else 2
  peak = cluster.peak[compute_dtype(config)]
  gemm, attn_rate = peak * cluster.matmul_eff, peak * cluster.attn_eff
  attn_flops = 2 * b * s * s * heads * hd / tp / cp   # QK^T and PV (2 x 2 b s^2 a d), causal: half; cp: a share
  # Time, not MFU's count (model/flop_count.py charges a sliding layer its window): at cp = 1 a
  # windowed layer runs as SDPA with a mask, whose kernels compute every block: no time saved
  attn_lin = 2 * n * (h * (heads + 2 * kv) * hd + heads * hd * h) / tp
  mlp_lin = 2 * n * (3 if gated else 2) * h * f / tp
  if is_moe:       # every TP rank routes all tokens (the router is whole) through its slice of the experts
    e, k, fe, shared = m.moe.num_experts, m.moe.top_k, moe.expert_ffn_size(m), m.moe.shared_expert_intermediate_size
    mlp_lin = 2 * n * (e * h + (k * 3 * h * fe + 3 * h * shared) / tp + (h if shared else 0))
  expert_lin = 2 * n * k * 3 * h * fe / tp if is_moe else 0
  sp = tp > 1 and d.sequence_parallel
  ew_attn, ew_mlp = elementwise_bytes(config, tp, cp, is_moe)
  ew_bw = cluster.ew_bw or cluster.mem_bw
  t_attn_lin, t_mlp, t_core = attn_lin / gemm, mlp_lin / gemm, attn_flops / attn_rate
  cast_f = cast_b = 0.0
  if config.precision.get('fp8'):    # the linears' GEMMs at the FP8 peak (a MoE's router and shared expert: 16-bit)
    fp8_gemm = cluster.peak.get('fp8', peak) * cluster.matmul_eff
    t_attn_lin = attn_lin / fp8_gemm
    t_mlp = mlp_lin / fp8_gemm if not is_moe else t_mlp - expert_lin / gemm + expert_lin / fp8_gemm
    cast_f, cast_b = (x / ew_bw for x in fp8_cast_bytes(config, tp, cp, ep, is_moe))
  if cp > 1:       # the ring: fp32 matmuls on materialized score blocks, not a fused kernel
    t_core = (attn_flops / (cluster.peak['fp32'] * cluster.matmul_eff)
              + _ring_score_bytes(b, s, heads, tp, cp) / cluster.mem_bw)
  t_ew_attn, t_ew_mlp = ew_attn / ew_bw, ew_mlp / ew_bw
  fwd = t_attn_lin + t_mlp + t_core + t_ew_attn + t_ew_mlp + cluster.layer_overhead / 3 + cast_f
  bwd = 2 * (t_attn_lin + t_mlp + t_core + t_ew_attn + t_ew_mlp + cluster.layer_overhead / 3) + cast_b
  granularity = m.activations_checkpoint_granularity
  parts = tuple(m.activations_checkpoint_recompute) if granularity == 'selective' else ()
  gather = _blocking(cluster, 'all_gather', n * h * w, tp)
  one = (gather + _blocking(cluster, 'reduce_scatter', n * h * w, tp) if sp
         else _blocking(cluster, 'all_reduce', n * h * w, tp))      # per sublayer: attention, MLP
  comm_f, comm_b = 2 * one, 2 * one     # a MoE sublayer reduces its partial sums as the dense MLP
  # On XLA the step is one graph and the collectives run on their own engines (Neuron: the CC
  # cores, started by the compute engines and awaited later), so the backward's input-gradient
  # collectives overlap the weight-gradient GEMMs, which do not depend on them. Eager code
  # (CPU, CUDA here) blocks on each.
  hidden = min(comm_b, t_attn_lin + t_mlp) if cluster.device == 'xla' else 0.0
  kv_elems = 2 * n * kv * hd / tp                          # this rank's K and V block
  ring_f, ring_b = _ring(cluster, cp, tp, t_core, kv_elems * w, kv_elems * 4)   # dK/dV travel in fp32
  a2a = 0.0
  if is_moe and ep > 1:
    a2a = 2 * collective(cluster, 'all_to_all', n * m.moe.top_k * h * w, ep,       # dispatch + combine
                         tp * cp * config.distributed_strategy.pipeline_model_parallel_size)
  a2a_b = a2a
  if granularity == 'full':
    bwd += fwd
    comm_b += comm_f
    ring_b += ring_f
    a2a_b += a2a
  else:                                          # selective: what the named regions recompute
    bwd += (t_core if 'attention' in parts else 0) + (t_mlp + t_ew_mlp / 2 + cast_f / 2 if 'mlp' in parts else 0)
    comm_b += one if 'mlp' in parts else 0  # the MLP's region holds its gather and its reduction
    ring_b += ring_f if 'attention' in parts else 0
    a2a_b += a2a if 'mlp' in parts else 0
    bwd += (t_ew_attn / 4 if 'norm' in parts else 0) + (t_ew_mlp / 4 if 'activation' in parts else 0)
  return fwd, bwd, {'tp': (comm_f, comm_b - hidden), 'cp': (ring_f, ring_b), 'ep': (a2a, a2a_b)}


def edge_comm(config, cluster, tp, cp=1, first_stage=True):
  """(forward s, backward s) of the TP collectives outside the layers, one micro batch
  (parallel/tensor.py): the vocab-parallel embedding's sum (first stage; under SP its slice's
  backward gather), the head's input (SP: gathered, its gradient reduce-scattered; TP: its
  gradient summed) and the loss's three per-token reductions (blocking, as the layers' are)."""
  if tp == 1:
    return 0.0, 0.0
  a, h = config.data, config.model.hidden_size
  n = a.micro_batch_size * a.seq_length // cp
  act = n * h * (4 if compute_dtype(config) == 'fp32' else 2)
  on = lambda op, size: _blocking(cluster, op, size, tp)     # pylint: disable=unnecessary-lambda-assignment
  sp = config.distributed_strategy.sequence_parallel
  fwd = 3 * on('all_reduce', n * 4)
  bwd = on('reduce_scatter', act) if sp else on('all_reduce', act)
  if sp:
    fwd += on('all_gather', act)
  if first_stage:
    fwd += on('all_reduce', act)
    bwd += on('all_gather', act) if sp else 0.0
  return fwd, bwd


def head_cost(config, cluster, tp, cp=1):
  """(forward s, backward s) of the LM head and the loss, one micro batch on the last stage."""
  m, a = config.model, config.data
  n, vocab = a.micro_batch_size * a.seq_length // cp, param_table.padded_vocab_size(m, tp) // tp
  gemm = cluster.peak[compute_dtype(config)] * cluster.matmul_eff
  flops = 2 * n * m.hidden_size * vocab
  # fp32 logits: the softmax and its gradient, read and written (or as measured, per element)
  ew = n * vocab * (cluster.logit_s / 2 if cluster.logit_s else 12 / cluster.mem_bw)
  chunk = m.fusions.get('chunked_cross_entropy', 0)
  over = cluster.micro_overhead
  return flops / gemm + ew + over / 3, 2 * flops / gemm + ew + (flops / gemm if chunk else 0) + 2 * over / 3
