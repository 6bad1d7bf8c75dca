"""Predicted step time of a config's layout on a cluster (parallel/clusters.py): what
tools/plan.py searches with, and what the start-up summary and --dry_run print.

One optimizer step on one rank of the slowest pipeline stage (the last: it holds the head) is

  pipeline makespan  the schedule simulator (parallel/schedule_sim.py) over per-micro-batch
                     forward and backward costs, each = GEMMs at matmul_eff of the compute
                     dtype's peak + attention at attn_eff + elementwise bytes / memory bandwidth
                     + the TP/SP collectives, in the layers and around them (embedding, head
                     input, loss; blocking: on the critical path, except on XLA, where the
                     backward's overlap the weight-gradient GEMMs), and the p2p exchange as
                     the simulator's comm cost; the bubble is what it adds
  + DP reduction     all-reduce of the gradient buckets (or ZeRO-1's collective): behind the
                     backward of the last micro batch when overlap_grad_reduce (all but the last
                     bucket), all of it when not, or on XLA (its compiler schedules one graph)
  + ZeRO-1 gather    the updated parameters' all-gather (or OR all-reduce): never overlapped
  + optimizer        bytes of parameters, gradients, masters and moments read and written /
                     memory bandwidth, over the rows this rank owns

Collectives cost what parallel/collective_cost.py says: alpha-beta rings over their group's
links, or on `local` each operation's measured curve.

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
dp x cp. Expert parallelism (ep) runs each MoE layer's top_k experts per
token (plus the router) on the whole sequence (experts are replicated over TP), with 4
all-to-alls of the routed tokens per layer (dispatch and combine, forward and backward), not
overlapped; expert gradients reduce over the dp / ep ranks holding the same experts, dense
ones over dp x cp.
"""
import dataclasses
import functools
import math

from model import layers, moe, transformer
from parallel import grad_buffer, precision, schedule_sim
from parallel.collective_cost import all_gather, collective, link, reduce_scatter

BACKENDS = {'cpu': 'gloo', 'cuda': 'nccl', 'xla': 'xla'}


@dataclasses.dataclass(frozen=True)
class Prediction:
  step_s: float
  tokens_per_s: float
  mfu: float
  bubble: float            # share of the step the pipeline's ranks idle in the bubble
  comm: float              # share of the step spent in exposed communication
  terms: dict              # seconds per step per term (see module doc)

  def line(self) -> str:
    return (f'{self.step_s:.3g} s/step, {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}, '
            f'bubble {self.bubble:.1%}, communication {self.comm:.1%}')


# --- per micro batch, per layer -----------------------------------------------------------

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
  heads, kv = m.num_attention_heads, transformer.kv_heads(m)
  ffn_act = (m.moe.top_k * moe.expert_ffn_size(m) + m.moe.shared_expert_intermediate_size if is_moe
             else m.ffn_hidden_size / tp)
  w = 4 if compute_dtype(config) == 'fp32' else 2
  local = n // tp if tp > 1 and d.sequence_parallel else n
  return (w * (local * h * (2 + 6) + 2 * n * (heads + kv) * hd / tp) + 8 * local * h,
          w * (local * h * (2 + 6) + 4 * n * ffn_act) + 8 * local * h)


def _blocking(cluster, op, n, tp):
  """A TP/SP collective the code waits on: its cost, plus local's measured wait for the other
  rank (sync_wait; 0 on the datasheet clusters, and nothing where there is no TP)."""
  return collective(cluster, op, n, tp) + (cluster.sync_wait if tp > 1 else 0.0)


def _layer_cost(config, cluster, tp, cp=1, ep=1, is_moe=False):
  """(forward s, backward s, {kind: (forward comm s, backward comm s)}) of one layer, one micro
  batch on one rank: kinds tp (TP/SP collectives), cp (ring exchange), ep (all-to-all)."""
  m, a, d = config.model, config.data, config.distributed_strategy
  b, s, h = a.micro_batch_size, a.seq_length, m.hidden_size
  n, hd = b * s // cp, transformer.head_dim(m)
  heads, kv, f = m.num_attention_heads, transformer.kv_heads(m), m.ffn_hidden_size
  gated = m.activation in layers.GATED
  w = 4 if compute_dtype(config) == 'fp32' else 2
  peak = cluster.peak[compute_dtype(config)]
  gemm, attn_rate = peak * cluster.matmul_eff, peak * cluster.attn_eff
  attn_flops = 2 * b * s * s * heads * hd / tp / cp   # QK^T and PV (2 x 2 b s^2 a d), causal: half; cp: a share
  attn_lin = 2 * n * (h * (heads + 2 * kv) * hd + heads * hd * h) / tp
  mlp_lin = 2 * n * (3 if gated else 2) * h * f / tp
  if is_moe:       # experts replicated over TP: the whole sequence's routed tokens on each TP rank
    e, k, fe, shared = m.moe.num_experts, m.moe.top_k, moe.expert_ffn_size(m), m.moe.shared_expert_intermediate_size
    mlp_lin = 2 * n * (e * h + k * 3 * h * fe + (3 * h * shared + h if shared else 0))
  sp = tp > 1 and d.sequence_parallel
  ew_attn, ew_mlp = elementwise_bytes(config, tp, cp, is_moe)
  t_attn_lin, t_mlp, t_core = attn_lin / gemm, mlp_lin / gemm, attn_flops / attn_rate
  if cp > 1:       # the ring: fp32 matmuls on materialized score blocks, not a fused kernel
    t_core = (attn_flops / (cluster.peak['fp32'] * cluster.matmul_eff)
              + _ring_score_bytes(b, s, heads, tp, cp) / cluster.mem_bw)
  ew_bw = cluster.ew_bw or cluster.mem_bw
  t_ew_attn, t_ew_mlp = ew_attn / ew_bw, ew_mlp / ew_bw
  fwd = t_attn_lin + t_mlp + t_core + t_ew_attn + t_ew_mlp + cluster.layer_overhead / 3
  bwd = 2 * (t_attn_lin + t_mlp + t_core + t_ew_attn + t_ew_mlp + cluster.layer_overhead / 3)
  granularity = m.activations_checkpoint_granularity
  parts = tuple(m.activations_checkpoint_recompute) if granularity == 'selective' else ()
  gather = _blocking(cluster, 'all_gather', n * h * w, tp)
  one = (gather + _blocking(cluster, 'reduce_scatter', n * h * w, tp) if sp
         else _blocking(cluster, 'all_reduce', n * h * w, tp))      # per sublayer: attention, MLP
  # a MoE sublayer's replicated experts need the whole sequence (SP: one gather, then a plain
  # slice) and no reduction (model/transformer.py)
  mlp_comm = (gather if sp else 0.0) if is_moe else one
  comm_f, comm_b = one + mlp_comm, one + mlp_comm
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
    bwd += (t_core if 'attention' in parts else 0) + (t_mlp + t_ew_mlp / 2 if 'mlp' in parts else 0)
    comm_b += mlp_comm if 'mlp' in parts else 0  # the MLP's region holds its gather and its reduction
    ring_b += ring_f if 'attention' in parts else 0
    a2a_b += a2a if 'mlp' in parts else 0
    bwd += (t_ew_attn / 4 if 'norm' in parts else 0) + (t_ew_mlp / 4 if 'activation' in parts else 0)
  return fwd, bwd, {'tp': (comm_f, comm_b - hidden), 'cp': (ring_f, ring_b), 'ep': (a2a, a2a_b)}


def _edge_comm(config, cluster, tp, cp=1, first_stage=True):
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


def blocking_tp_calls(config, cluster, world_size) -> float:
  """Blocking TP/SP collectives per step that `predict` charges (each one sync_wait more)."""
  waits = [predict(config, dataclasses.replace(cluster, sync_wait=w), world_size).terms['tp_comm'] for w in (0.0, 1.0)]
  return waits[1] - waits[0]


def _head_cost(config, cluster, tp, cp=1):
  """(forward s, backward s) of the LM head and the loss, one micro batch on the last stage."""
  m, a = config.model, config.data
  n, vocab = a.micro_batch_size * a.seq_length // cp, transformer.padded_vocab_size(m, tp) // tp
  gemm = cluster.peak[compute_dtype(config)] * cluster.matmul_eff
  flops = 2 * n * m.hidden_size * vocab
  # fp32 logits: the softmax and its gradient, read and written (or as measured, per element)
  ew = n * vocab * (cluster.logit_s / 2 if cluster.logit_s else 12 / cluster.mem_bw)
  chunk = m.fusions.get('chunked_cross_entropy', 0)
  over = cluster.micro_overhead
  return flops / gemm + ew + over / 3, 2 * flops / gemm + ew + (flops / gemm if chunk else 0) + 2 * over / 3


@functools.lru_cache(maxsize=4096)
def _makespan(p, mb, v, bwd_ratio, comm_ratio):
  return schedule_sim.simulate(p, mb, v, 1.0, bwd_ratio, comm_ratio).makespan


def pipeline(p, mb, v, fwd, bwd, comm) -> float:
  """Makespan of `mb` micro batches over p stages (v chunks each) at forward / backward /
  exchange costs per micro batch and stage: the simulator's, scaled (makespan is linear in
  the three costs; backward / forward is rounded to 2 digits and exchange / forward to 0.01
  to share cached runs: the search
  then simulates a few dozen schedules, not thousands)."""
  if p == 1:
    return mb * (fwd + bwd)
  f = fwd / v
  r = lambda x: float(f'{x / f:.2g}')     # pylint: disable=unnecessary-lambda-assignment
  short, long = p, 2 * p
  c = round(comm / f, 2)
  if mb <= long:
    return f * _makespan(p, mb, v, r(bwd / v), c)
  # Past the warm-up each more micro batch adds the same steady-state time: extrapolate from
  # two simulated lengths, p and 2p (exact for these schedules; simulating m = 1024 takes seconds).
  a, b = _makespan(p, short, v, r(bwd / v), c), _makespan(p, long, v, r(bwd / v), c)
  return f * (b + (mb - long) * (b - a) / (long - short))


def _reduce(zero1, d, backend, params, gsize, pbytes, cluster, g, stride):
  """(gradient reduction s, ZeRO-1 parameter gather s) of `params` trained parameters over g
  ranks `stride` apart."""
  on = lambda op, n: collective(cluster, op, n, g, stride)     # pylint: disable=unnecessary-lambda-assignment
  if not zero1 or g == 1:
    return on('all_reduce', params * gsize), 0.0
  if grad_buffer.backend_choice(d.zero1_collectives, backend) == 'all_reduce':
    return on('all_reduce', params * gsize), on('all_reduce', params * pbytes)
  return on('reduce_scatter', params * gsize), on('all_gather', params * pbytes)


# --- the step -----------------------------------------------------------------------------

def predict(config, cluster, world_size, fsdp=False, counts=None, slower_than=None):
  """The step of `config`'s layout at `world_size` ranks of `cluster`. `fsdp`: model the data
  parallelism as FSDP / ZeRO-3 (torchtitan's: parameters gathered per layer before forward and
  backward, gradients reduce-scattered, all prefetched behind compute), which flatron lacks:
  for comparing with published FSDP figures only. `counts`: (parameters, trainable, FLOPs per
  token) of the whole model when the caller has them (the search: counting walks every parameter).
  `slower_than`: None instead of a Prediction when the step cannot be shorter than this many
  seconds even with no bubble (the search's cut: the pipeline simulation is its cost)."""
  d, m, a = config.distributed_strategy, config.model, config.data
  tp, pp, v = d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.virtual_pipeline_model_parallel_size
  cp, ep = d.get('context_parallel_size', 1), d.get('expert_model_parallel_size', 1)
  dp = world_size // (tp * pp * cp)
  recipe = precision.recipe(config.precision)
  micro = a.global_batch_size // (a.micro_batch_size * dp)
  layers_here = math.ceil(m.num_layers / pp)
  # the last stage's layers: how many of them are MoE (every moe.frequency-th)
  moe_here = sum(moe.is_moe_layer(m, i) for i in range(m.num_layers - layers_here, m.num_layers))
  dense = _layer_cost(config, cluster, tp, cp)
  sparse = _layer_cost(config, cluster, tp, cp, ep, is_moe=True) if moe_here else dense
  per_layer = [(layers_here - moe_here, dense), (moe_here, sparse)]
  lf = sum(k * c[0] for k, c in per_layer)                      # the stage's layers, all kinds
  lb = sum(k * c[1] for k, c in per_layer)
  layer_comm = {kind: tuple(sum(k * c[2][kind][i] for k, c in per_layer) for i in (0, 1)) for kind in dense[2]}
  cf, cb = (sum(f for f, _ in layer_comm.values()), sum(b for _, b in layer_comm.values()))
  hf, hb = _head_cost(config, cluster, tp, cp)
  w = 4 if compute_dtype(config) == 'fp32' else 2
  n = a.micro_batch_size * a.seq_length // cp
  sp = tp > 1 and d.sequence_parallel
  exchange = collective(cluster, 'p2p', n * m.hidden_size * w // (tp if sp else 1), pp, tp * cp)
  ef, eb = _edge_comm(config, cluster, tp, cp, first_stage=pp == 1)
  cf, cb = cf + ef, cb + eb
  fwd = lf + cf + hf
  bwd = lb + cb + hb
  total, trained, per_token = counts or (transformer.count_params(m), transformer.count_params(m, trainable_only=True),
                                         transformer.flops_per_token(m, a.seq_length))
  # experts: replicated over TP, 1/ep of them per rank, gradients summed over the dp / ep ranks
  # holding the same ones (parallel/experts.py); a LoRA run freezes them
  experts = (len(moe.moe_layers(m)) * m.moe.num_experts * 3 * moe.expert_ffn_size(m) * m.hidden_size
             if moe.enabled(m) else 0)
  experts_trained = experts if trained == total else 0
  params_rank = (total - experts) / (tp * pp) + experts / (pp * ep)
  dense_trained, expert_trained = (trained - experts_trained) / (tp * pp), experts_trained / (pp * ep)
  trainable = dense_trained + expert_trained
  group, expert_group = dp * cp, dp // ep        # dense gradients reduce over dp x cp, experts' over expert-DP
  dp_bw, dp_lat = link(cluster, group, tp * pp)  # (cp sits inside dp: the group's ranks average tp x pp apart)
  gsize = recipe.grad_acc_dtype.itemsize
  grads = trainable * gsize
  fsdp_exposed = 0.0
  if fsdp and dp > 1:     # per layer: gather params for forward and backward, reduce-scatter grads
    per_layer_params = params_rank / m.num_layers
    gather = all_gather(per_layer_params * recipe.compute_dtype.itemsize, dp, dp_bw, dp_lat)
    scatter = reduce_scatter(per_layer_params * 4, dp, dp_bw, dp_lat)
    fsdp_exposed = micro * layers_here * (max(0.0, gather - (lf + cf) / layers_here)
                                          + max(0.0, gather + scatter - (lb + cb) / layers_here))
  backend = BACKENDS.get(cluster.device, 'nccl')
  zero1 = d.zero1 and not fsdp
  gather = 0.0
  if fsdp:
    reduction = 0.0
  else:
    pbytes = recipe.param_dtype.itemsize
    reduction, gather = _reduce(zero1, d, backend, dense_trained, gsize, pbytes, cluster, group, tp * pp)
    if expert_trained:
      r, g = _reduce(zero1, d, backend, expert_trained, gsize, pbytes, cluster, expert_group, ep * tp * pp * cp)
      reduction, gather = reduction + r, gather + g
  buckets = max(1, math.ceil(grads / (config.bucket_size_collectives * 2**20)))
  if d.overlap_grad_reduce and cluster.device != 'xla':
    exposed = max(reduction / buckets, reduction - bwd * (1 - 1 / buckets))
  else:
    exposed = reduction
  master = 4 if recipe.has_master(recipe.param_dtype) else 0
  state = 2 * recipe.state_dtype(recipe.param_dtype).itemsize
  per_param = 2 * (recipe.param_dtype.itemsize + master + state) + 2 * recipe.grad_acc_dtype.itemsize
  if fsdp:
    owned = trainable / dp if dp > 1 else trainable
  elif zero1:
    owned = dense_trained / group + expert_trained / max(1, expert_group)
  else:
    owned = trainable
  optimizer = (owned * per_param / cluster.mem_bw + layers_here * cluster.layer_step_overhead
               + cluster.step_overhead)
  rest = fsdp_exposed + exposed + gather + optimizer
  if slower_than is not None and micro * (fwd + bwd) + rest > slower_than:
    return None          # slower whatever the bubble (every stage runs all its micro batches)
  makespan = pipeline(pp, micro, v, fwd, bwd, exchange)
  ideal = micro * (fwd + bwd + (2 * exchange if pp > 1 else 0))
  terms = {'compute': micro * (fwd + bwd - cf - cb), 'tp_comm': micro * (sum(layer_comm['tp']) + ef + eb),
           'cp_comm': micro * sum(layer_comm['cp']), 'ep_comm': micro * sum(layer_comm['ep']),
           'pp_comm': 2 * micro * exchange if pp > 1 else 0.0, 'bubble': max(0.0, makespan - ideal),
           'fsdp_comm': fsdp_exposed, 'dp_comm': exposed, 'zero1_gather': gather, 'optimizer': optimizer}
  step = makespan + rest
  tokens = a.global_batch_size * a.seq_length / step
  flops = per_token * tokens
  comm = terms['tp_comm'] + terms['cp_comm'] + terms['ep_comm'] + terms['pp_comm'] + fsdp_exposed + exposed + gather
  return Prediction(step, tokens, flops / (world_size * cluster.peak[compute_dtype(config)]),
                    terms['bubble'] / step, comm / step, terms)
