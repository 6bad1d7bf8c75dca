"""Predicted step time of a config's layout on a cluster (estimates/clusters.py): what
tools/plan.py searches with, and what the start-up summary and --dry_run print.

One optimizer step on one rank of the slowest pipeline stage (the last: it holds the head) is

  pipeline makespan  the schedule simulator (estimates/schedule_sim.py) over per-micro-batch
                     forward and backward costs, each = GEMMs at matmul_eff of the compute
                     dtype's peak + attention at attn_eff + elementwise bytes / memory bandwidth
                     + the TP/SP collectives, in the layers and around them (embedding, head
                     input, loss; blocking: on the critical path, except on XLA, where the
                     backward's overlap the weight-gradient GEMMs), and the p2p exchange as
                     the simulator's comm cost; the bubble is what it adds
  + DP reduction     all-reduce of the gradient buckets (or ZeRO-1's collective): behind the
                     backward of the last micro batch when overlap_grad_reduce (all but the last
                     bucket), all of it when not, or on XLA (its compiler schedules one graph);
                     ZeRO-2 and -3 reduce-scatter behind every micro batch's backward; HSDP then
                     all-reduces the owned rows across the replica groups (not overlapped)
  + ZeRO-1 gather    the updated parameters' all-gather (or OR all-reduce): never overlapped
  + ZeRO-3 gathers   per layer and micro batch the parameters gathered for the forward and
                     again for the backward (not with reshard_after_forward=False), each behind
                     the previous layer's compute (prefetch): what exceeds it is exposed
  + optimizer        bytes of parameters, gradients, masters and moments read and written /
                     memory bandwidth, over the rows this rank owns

Collectives cost what estimates/collective_cost.py says: alpha-beta rings over their group's
links, or on `local` each operation's measured curve.

The per-micro-batch costs (each layer's, the collectives outside the layers, the head's; the
`local` cluster's measured rates and overheads; context and expert parallelism) are
estimates/micro_batch_cost.py's.
"""
import dataclasses
import functools
import math

from estimates import schedule_sim
from estimates.collective_cost import all_gather, collective, link, reduce_scatter
from estimates.micro_batch_cost import compute_dtype, edge_comm, head_cost, layer_cost
from model import flop_count, lora, moe, param_table
from numerics import precision
from parallel import grad_reduce


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


# --- the step -----------------------------------------------------------------------------

def blocking_tp_calls(config, cluster, world_size) -> float:
  """Blocking TP/SP collectives per step that `predict` charges (each one sync_wait more)."""
  waits = [predict(config, dataclasses.replace(cluster, sync_wait=w), world_size).terms['tp_comm'] for w in (0.0, 1.0)]
  return waits[1] - waits[0]


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


def _reduce(zero1, d, params, gsize, pbytes, cluster, g, stride):
  """(gradient reduction s, ZeRO-1 parameter gather s) of `params` trained parameters over g
  ranks `stride` apart."""
  on = lambda op, n: collective(cluster, op, n, g, stride)     # pylint: disable=unnecessary-lambda-assignment
  if not zero1 or g == 1:
    return on('all_reduce', params * gsize), 0.0
  if grad_reduce.resolved(d.zero1_collectives) == 'all_reduce':
    return on('all_reduce', params * gsize), on('all_reduce', params * pbytes)
  return on('reduce_scatter', params * gsize), on('all_gather', params * pbytes)


def zero_stage(config, dp_cp) -> int:
  """ZeRO's stage where it shards anything (0: plain DP, or a single DP x CP rank)."""
  d = config.distributed_strategy
  return d.get('zero_stage', 1) if d.zero1 and dp_cp > 1 else 0


def predict(config, cluster, world_size, counts=None, slower_than=None):
  """The step of `config`'s layout at `world_size` ranks of `cluster`. `counts`: (parameters, trainable, FLOPs per
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
  dense = layer_cost(config, cluster, tp, cp)
  sparse = layer_cost(config, cluster, tp, cp, ep, is_moe=True) if moe_here else dense
  per_layer = [(layers_here - moe_here, dense), (moe_here, sparse)]
  lf = sum(k * c[0] for k, c in per_layer)                      # the stage's layers, all kinds
  lb = sum(k * c[1] for k, c in per_layer)
  layer_comm = {kind: tuple(sum(k * c[2][kind][i] for k, c in per_layer) for i in (0, 1)) for kind in dense[2]}
  cf, cb = (sum(f for f, _ in layer_comm.values()), sum(b for _, b in layer_comm.values()))
  hf, hb = head_cost(config, cluster, tp, cp)
  w = 4 if compute_dtype(config) == 'fp32' else 2
  n = a.micro_batch_size * a.seq_length // cp
  sp = tp > 1 and d.sequence_parallel
  exchange = collective(cluster, 'p2p', n * m.hidden_size * w // (tp if sp else 1), pp, tp * cp)
  ef, eb = edge_comm(config, cluster, tp, cp, first_stage=pp == 1)
  cf, cb = cf + ef, cb + eb
  fwd = lf + cf + hf
  bwd = lb + cb + hb
  total, trained, per_token = counts or (param_table.count_params(m), param_table.count_params(m, trainable_only=True),
                                         flop_count.flops_per_token(m, a.seq_length))
  # experts: split over TP, 1/ep of them per rank, gradients summed over the dp / ep ranks
  # holding the same ones (parallel/experts.py); a LoRA run freezes them
  experts = (len(moe.moe_layers(m)) * m.moe.num_experts * 3 * moe.expert_ffn_size(m) * m.hidden_size
             if moe.enabled(m) else 0)
  experts_trained = experts if lora.settings(m) is None else 0
  params_rank = (total - experts) / (tp * pp) + experts / (tp * pp * ep)
  dense_trained, expert_trained = (trained - experts_trained) / (tp * pp), experts_trained / (tp * pp * ep)
  trainable = dense_trained + expert_trained
  stage = zero_stage(config, dp * cp)
  # dense gradients reduce over dp x cp (HSDP: ZeRO's shard group, then across the replicas),
  # experts' over expert-DP (then across cp: parallel/experts.py replicas; at ep 1 with the
  # dense ones); cp sits inside dp: the group's ranks average tp x pp apart
  group = (d.get('data_parallel_shard_size', 0) or dp * cp) if stage else dp * cp
  expert_group = dp // ep if ep > 1 else dp * cp
  dp_bw, dp_lat = link(cluster, group, tp * pp)
  gsize, pbytes = recipe.grad_acc_dtype.itemsize, recipe.param_dtype.itemsize
  grads = trainable * gsize
  fsdp_exposed = 0.0
  per_micro = d.get('grad_reduce_per_micro_batch', True)
  if stage == 3:          # per layer: gather params for forward (and backward), reduce-scatter grads
    per_layer_params = params_rank / m.num_layers
    gather = all_gather(per_layer_params * pbytes, group, dp_bw, dp_lat)
    scatter = reduce_scatter(per_layer_params * gsize, group, dp_bw, dp_lat) if per_micro else 0.0
    again = gather if d.get('reshard_after_forward', True) else 0.0
    gathering = micro if d.get('reshard_after_backward', True) else 1     # micro batches that gather
    fsdp_exposed = layers_here * (gathering * max(0.0, gather - (lf + cf) / layers_here)
                                  + gathering * max(0.0, again - (lb + cb) / layers_here)
                                  + micro * max(0.0, scatter - (lb + cb) / layers_here))
  reduction, gather = _reduce(bool(stage), d, dense_trained, gsize, pbytes, cluster, group, tp * pp)
  if expert_trained:
    r, g = _reduce(bool(stage), d, expert_trained, gsize, pbytes, cluster, expert_group, ep * tp * pp * cp)
    reduction, gather = reduction + r, gather + g
  buckets = max(1, math.ceil(grads / (config.bucket_size_collectives * 2**20)))
  if stage == 3:          # nothing to gather after the update; per micro batch the reduction is in fsdp_exposed
    gather = 0.0
    reduction = 0.0 if per_micro else reduction
  elif stage == 2:        # once per micro batch, each behind that micro batch's backward
    reduction *= micro
  overlapped = bwd * micro if stage == 2 else bwd
  if d.overlap_grad_reduce and cluster.device != 'xla':
    exposed = max(reduction / buckets, reduction - overlapped * (1 - 1 / buckets))
  else:
    exposed = reduction
  replicas = dp * cp // group
  if replicas > 1:        # HSDP: the owned rows' all-reduce across the replica groups, after the backward
    exposed += collective(cluster, 'all_reduce', dense_trained / group * gsize, replicas, group * tp * pp)
  if expert_trained and ep > 1 and cp > 1:    # the experts' owned rows across the cp ranks, after the backward
    owned_experts = expert_trained / (expert_group if stage else 1)
    exposed += collective(cluster, 'all_reduce', owned_experts * gsize, cp, tp)
  master = 4 if recipe.has_master(recipe.param_dtype) else 0
  state = 2 * recipe.state_dtype(recipe.param_dtype).itemsize
  per_param = 2 * (recipe.param_dtype.itemsize + master + state) + 2 * recipe.grad_acc_dtype.itemsize
  if stage:
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
