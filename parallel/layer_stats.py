"""Per-layer statistics on logged steps (exp_manager.log_layer_stats): where a run's gradients
grow, which layers' weights drift, which MoE layers route unevenly.

    grad_norm/layers.N   the L2 norm of layer N's gradients (before clipping), adapters' with LoRA
    grad_norm/<group>    of every layer's parameters of a group: attention, mlp, experts, router,
                         norms, embedding, head (GROUPS; a model without one leaves it out)
    param_norm/layers.N, param_norm/<group>   the same of the parameters after the step
    moe_load/layers.N    the busiest expert's tokens over the mean, over the step's global batch

Every number is the one-device model's: each rank adds the squares of the boxes it counts in the
global norms (parallel/grads.py counts_once: a TP-replicated tensor on one TP rank), the sums
are added over the groups whose boxes are disjoint (ZeRO's row shards, the experts' EP group:
parallel/experts.py norm_group), then over TP and PP, one all-reduce each; the expert loads
over DP x CP (EP's ranks among them) and PP. Computed only on logged steps, as device tensors
the step's one read brings to the host (logs.StepReporter).
"""
import re

import torch

from model import moe, param_table
from parallel import comm, experts, grads

GROUPS = ('attention', 'mlp', 'experts', 'router', 'norms', 'embedding', 'head')
_LAYER = re.compile(r'layers\.(\d+)\.')
_ROUTER = re.compile(r'\.mlp\.gate\.(weight|bias|e_score_correction_bias)$')


def group_of(name) -> str:
  """The parameter group of global parameter `name` (adapters count with the layer they adapt)."""
  if name.startswith('embed_'):
    return 'embedding'
  if name.startswith('lm_head'):
    return 'head'
  if '.self_attn.' in name:
    return 'attention'
  if '.mlp.experts.' in name:
    return 'experts'
  if _ROUTER.search(name):
    return 'router'
  if '.mlp.' in name:
    return 'mlp'
  return 'norms'


def buckets(model_cfg) -> list:
  """The statistics' names in a fixed order (the same on every rank): per layer, then per group."""
  names = param_table.param_specs(model_cfg)
  groups = [g for g in GROUPS if any(group_of(n) == g for n in names)]
  return [f'layers.{i}' for i in range(model_cfg.num_layers)] + groups


def _indices(name, index):
  layer = _LAYER.match(name)
  return ([index[f'layers.{layer.group(1)}']] if layer else []) + [index[group_of(name)]]


def norms(tensors, updater, zero1, model_cfg) -> torch.Tensor:
  """[len(buckets)] fp32: the global L2 norm of each bucket of `tensors` (name -> this rank's box
  or owned rows; `zero1`: whether they are ZeRO's row shards)."""
  mesh, names = updater.mesh, buckets(model_cfg)
  index = {b: i for i, b in enumerate(names)}
  by_group = {}
  for n, t in tensors.items():
    if t is not None and grads.counts_once(n, mesh, updater.layouts[n]):
      by_group.setdefault(experts.norm_group(mesh, n, zero1), []).append(n)
  total = torch.zeros(len(names), device=mesh.device)
  for group, members in by_group.items():
    squares = grads.square_sums([tensors[n] for n in members])
    pairs = [(i, square) for n, square in zip(members, squares) for i in _indices(n, index)]
    part = torch.zeros(len(names), device=mesh.device).index_add_(
        0, torch.tensor([i for i, _ in pairs], device=mesh.device), torch.stack([s for _, s in pairs]))
    total += comm.all_reduce_(part, group, name='all_reduce(layer norms over shards)')
  return grads.over_tp_pp(total, mesh).sqrt()


def expert_loads(loads, mesh, model_cfg) -> torch.Tensor:
  """[MoE layers] fp32: each MoE layer's busiest expert over the mean, from `loads` (layer prefix
  -> this rank's kept tokens per expert over the step's micro batches)."""
  layers = moe.moe_layers(model_cfg)
  counts = torch.zeros(len(layers), model_cfg.moe.num_experts, device=mesh.device)
  for prefix, c in (loads or {}).items():
    counts[layers.index(int(prefix.split('.')[1]))] = c
  counts = comm.all_reduce_(counts, mesh.dp_cp_group, name='all_reduce(expert loads over dp)')
  counts = comm.all_reduce_(counts, mesh.pp_group, name='all_reduce(expert loads over pp)')
  return counts.amax(-1) / counts.mean(-1)


def gradient_norms(gradients, updater, model_cfg) -> dict:
  """grad_norm/<bucket> (0-dim device tensors) of `gradients` (this rank's owned rows, before clipping)."""
  values = norms(gradients, updater, updater.zero1, model_cfg)
  return {f'grad_norm/{b}': v for b, v in zip(buckets(model_cfg), values)}


def after_step(params, updater, loads, model_cfg) -> dict:
  """param_norm/<bucket> of `params` after the update, and moe_load/layers.N from `loads`."""
  if updater.shards is not None:                   # ZeRO-3: each rank's rows of every parameter
    values = norms(updater.shards.shard, updater, True, model_cfg)
  else:
    updater.wait_params()
    values = norms(params, updater, False, model_cfg)
  out = {f'param_norm/{b}': v for b, v in zip(buckets(model_cfg), values)}
  if moe.enabled(model_cfg):
    layers = moe.moe_layers(model_cfg)
    out.update({f'moe_load/layers.{i}': v for i, v in zip(layers, expert_loads(loads, updater.mesh, model_cfg))})
  return out


def check(config) -> list:
  m = config.model
  if config.exp_manager.log_layer_stats and moe.enabled(m) and m.compile:
    return ['exp_manager.log_layer_stats=True with MoE and model.compile=True: the per-layer loads are not counted '
            'inside compiled blocks yet; set model.compile=False or log_layer_stats=False']
  return []
