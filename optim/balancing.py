"""DeepSeek-V3's auxiliary-loss-free load balancing (model.moe.load_balance_bias, with
moe.load_balance_rate > 0).

Each MoE layer has a correction bias b [E] (`mlp.gate.e_score_correction_bias`) that is added
to the router's scores to choose the experts, never to weigh them (model/moe.py route). No
gradient trains it (lora.UNTRAINED): after each optimizer step it moves toward balance,

    b_e <- b_e + rate * sign(mean load - load_e),

load_e being the tokens routed to expert e in the whole step (model/router_losses.py counts
them as the layers route, training passes only): every micro batch, summed over the
data- and context-parallel ranks (expert parallelism's among them), so every layout makes the
same update. A step the non-finite check skips changes nothing. The bias is a parameter, so
checkpoints keep it and a resumed run goes on bitwise. It composes with the auxiliary losses
(moe.output_router_logits, router_z_loss_coef) or replaces them (coefficients 0).
"""
import torch

from parallel import comm, param_shards

BIAS = '.gate.e_score_correction_bias'


def update(params, loads, config, mesh, updated=True):
  """Move each of this stage's correction biases by the step's global expert loads (`loads`:
  MoE layer prefix -> this rank's counts over its micro batches). `updated`: whether the
  optimizer applied the step (XLA: a device bool, so no sync: the move is then times it)."""
  rate = config.model.moe.get('load_balance_rate', 0.0)
  if not rate or not loads or updated is False:
    return
  layers = sorted(loads)
  counts = comm.all_reduce_(torch.stack([loads[n] for n in layers]), mesh.dp_cp_group,
                            name='all_reduce(expert loads over dp)')
  step = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
  if torch.is_tensor(updated):
    step = step * updated.to(step.dtype)
  shards = param_shards.shards_of(params)
  with torch.no_grad():
    for layer, delta in zip(layers, step):
      name = layer + BIAS
      if shards is not None:        # ZeRO-3: this rank's rows of it
        target, rows = shards.shard[name], shards.rows[name]
        target.add_(delta[rows].to(target.dtype))
      else:
        params[name].add_(delta.to(params[name].dtype))
