"""The MoE auxiliary losses and routing metrics: what each MoE layer's routing adds to the
objective, summed per sequence over every MoE layer of the model (model/moe.py routes).

Auxiliary losses, per sequence and then averaged over sequences weighted by their loss count
(the objective's per-row count: loss tokens, or 1 per preference pair), so every layout
computes the same number. Every token of the row counts (packed documents and padding
alike: the router sees them all, as HF's with an all-ones attention_mask):
  load balancing (HF's load_balancing_loss_func, all MoE layers together):
    aux = E * sum_e (c_e / N) (P_e / N),  c_e = top-k assignments to e over layers and tokens,
                                          P_e = sum of p_e over them, N = MoE layers x tokens
  router z-loss (ST-MoE):  z = mean over layers and tokens of logsumexp(logits)^2
  loss = LM loss + router_aux_loss_coef * aux (with output_router_logits) + router_z_loss_coef * z

Under context parallelism a rank holds a slice of each row (`whole_row`, the sum over the cp
ranks): the counts c_e and the row weights are summed over the slices, so every rank knows the
whole row's; P_e and z stay the slice's own, and as aux is linear in P for given counts, each
rank's loss share E sum_e (c_e / N)(P_e / N) adds up over the ranks to the whole row's, the
gradient of each probability exact. The metrics from whole counts (load, dropped) are the same
on every rank and weighted by the slice's own loss count, which adds up to the row's.
"""
import torch
import torch.nn.functional as F

from model import moe

EXPERT_LOADS = 'expert_loads'    # the tally's per-layer loads (not a logged metric)
METRICS = ('lm_loss', 'moe_aux_loss', 'moe_z_loss', 'moe_load_max_over_mean', 'moe_dropped_fraction')


def carry_width(cfg) -> int:
  """Per row, what a pipeline stage passes on for the auxiliary losses (Collector.carry)."""
  return 2 * cfg.moe.num_experts + 1


def _add(loads, layer, counts):
  loads[layer] = loads.get(layer, 0) + counts


class Collector:
  """One stage's routing sums for one micro batch: per-row sums for the auxiliary losses and the
  metrics over its MoE layers, added as each layer runs. They are running tensors, not a list of
  per-layer records: model.compile traces every layer as one graph, and a list growing inside it
  (or a Python count) would be guarded on, recompiling the block once per MoE layer. A recompute
  pass runs the layers again in the backward, after `finish` has read the sums: it keeps
  nothing (`finished`), as its records would never be read and would keep each recomputed
  layer's graph, attention scores and all, alive until the micro batch's end (full recompute of
  a MoE model then held every layer's insides at once: found tracing NxD's Mixtral files).

  Under pipeline parallelism the losses need every MoE layer's sums: each stage receives the
  earlier stages' (`carried`, [b, carry_width]: top-k counts per expert, router
  probabilities summed per expert, z summed; fp32), adds its own and passes them on with its
  activations; the last stage computes the losses from the totals, and their gradient reaches
  every stage's probabilities and z through the carried sums, as the activations' does."""

  def __init__(self, cfg, row_weights_b, tokens, carried=None, layers=None, whole_row=None, count_loads=False):
    """`tokens`: the whole row's; `layers`: how many MoE layers this stage runs (known from its
    layer range, so nothing is read back from the device; None: those recorded, counted on the
    device); `whole_row(x)`: x summed over the slices of the rows (context parallelism), None: one;
    `count_loads`: count each layer's load in training passes (as moe.load_balance_rate does)."""
    self.cfg, self.w, self.tokens, self.carried, self.layers_here = cfg, row_weights_b.float(), tokens, carried, layers
    self.whole_row = whole_row or (lambda x: x)
    self.count_loads = count_loads or bool(cfg.moe.get('load_balance_rate', 0.0))
    self.w_row = self.whole_row(self.w)          # the whole rows' weights
    e, zeros = cfg.moe.num_experts, lambda *shape: torch.zeros(shape, device=self.w.device)
    b = self.w.shape[0]
    if carried is None:
      self.counts, self.probs, self.z = zeros(b, e), zeros(b, e), zeros(b)
    else:               # the earlier stages' sums first: the same order of additions as one stage
      self.counts, self.probs, self.z = (t.contiguous() for t in (carried[:, :e], carried[:, e:2 * e], carried[:, -1]))
    # The sums look alike before and after each layer's record (contiguous, and needing a gradient
    # where the records' do), or the compiled block would be traced again for the second MoE layer.
    for t in (self.probs, self.z):
      if torch.is_grad_enabled() and not t.requires_grad:
        t.requires_grad_()
    self.load, self.dropped, self.layers = zeros(b), zeros(b), zeros()   # this stage's MoE layers
    self.finished = False
    self.expert_loads = {}      # layer -> kept assignments per expert, for model/balancing.py

  def record(self, logits, probs, experts, kept, layer=None):
    """One MoE layer's routing; `layer` (its prefix) also counts its load per expert where
    moe.load_balance_rate moves the correction biases by it, or the per-layer statistics read it
    (training passes only)."""
    e = self.cfg.moe.num_experts
    onehot = F.one_hot(experts, e)                                 # [b, s, k, E]
    # the whole rows' top-k assignments and kept ones per expert [b, E]
    chosen, kept_counts = self.whole_row(torch.stack([onehot.sum((1, 2)), (onehot * kept[..., None]).sum((1, 2))]).float())
    sums = (self.counts + chosen, self.probs + probs.sum(1),
            self.z + torch.logsumexp(logits.float(), dim=-1).pow(2).sum(1),
            self.load + kept_counts.max(-1).values / kept_counts.mean(-1),
            self.dropped + (1 - kept_counts.sum(-1) / (self.tokens * experts.shape[-1])), self.layers + 1)
    # a recompute pass in the backward runs the same operations (checkpoint checks it saves the
    # same tensors) but keeps nothing: its sums are never read
    if not self.finished:
      self.counts, self.probs, self.z, self.load, self.dropped, self.layers = sums
      if layer is not None and self.count_loads and torch.is_grad_enabled():
        counts = torch.zeros(e, device=experts.device).index_add_(0, experts.reshape(-1), kept.reshape(-1).float())
        _add(self.expert_loads, layer, counts)

  def sums(self):
    """(counts [b, E], probs [b, E], z [b]): this stage's layers' sums plus the carried ones."""
    return self.counts, self.probs, self.z

  def _recorded(self) -> int:
    return self.layers_here if self.layers_here is not None else int(self.layers)

  def carry(self):
    """What the next stage receives: the sums so far, [b, carry_width] fp32."""
    counts, probs, z = self.sums()
    return torch.cat([counts, probs, z[:, None]], dim=-1)

  def losses(self):
    """(aux [b], z [b]) per row over every MoE layer (recorded here or carried)."""
    n = len(moe.moe_layers(self.cfg)) * self.tokens
    counts, probs, z = self.sums()
    aux = self.cfg.moe.num_experts * ((counts / n) * (probs / n)).sum(-1)
    return aux, z / n

  def loss_sum(self):
    """The auxiliary losses' share of the objective's loss sum (weighted rows)."""
    moe = self.cfg.moe
    aux, z = self.losses()
    total = moe.router_z_loss_coef * z
    if moe.output_router_logits:
      total = total + moe.router_aux_loss_coef * aux
    return (total * self.w_row).sum()

  def finish(self, tally, last, objective_adds):
    """After the stage's layers: the metric sums added into `tally` (a dict, or None), and, on
    the `last` stage when `objective_adds` them, the auxiliary losses' share of the loss sum
    (None when nothing adds)."""
    self.finished = True
    # carried sums reach the last stage with every layer's; without, one stage must hold them all
    all_layers = last if self.carried is not None else self._recorded() == len(moe.moe_layers(self.cfg))
    if tally is not None:
      for name, value in self.metric_sums(all_layers).items():
        tally[name] = tally.get(name, 0) + value
      for layer, counts in self.expert_loads.items():
        _add(tally.setdefault(EXPERT_LOADS, {}), layer, counts)
    if not (last and objective_adds and moe.adds_loss(self.cfg)):
      return None
    if not all_layers:
      raise ValueError('model.moe auxiliary losses need every MoE layer\'s sums on the last stage (pass moe_carry)')
    return self.loss_sum()

  def metric_sums(self, all_layers) -> dict:
    """Weighted per-row sums of METRICS; load and dropped are means over all MoE layers (this
    stage's share), the losses only where `all_layers` were recorded here (else 0). Under cp the
    losses are this slice's share of the row's (weighted by the row's count), load and dropped
    the whole row's (weighted by the slice's count)."""
    n_layers = len(moe.moe_layers(self.cfg))
    out = {name: torch.zeros((), device=self.w.device) for name in METRICS}
    if not self._recorded():
      return out
    out['moe_load_max_over_mean'] = (self.load / n_layers * self.w).sum()
    out['moe_dropped_fraction'] = (self.dropped / n_layers * self.w).sum()
    if all_layers:
      aux, z = self.losses()
      out['moe_aux_loss'], out['moe_z_loss'] = (aux.detach() * self.w_row).sum(), (z.detach() * self.w_row).sum()
    return out
