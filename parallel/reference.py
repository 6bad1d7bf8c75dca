"""DPO's reference model on the mesh: which parameters it is, and its log-probs of each pair,
computed through the same pipeline (forward only) as the policy.

The reference is the starting model. With LoRA it is the policy's own base with the adapters
switched off (the same tensors: no memory); without, a frozen copy sharded like the policy,
or (dpo.precompute_ref_log_probs) that copy's log-probs of every row of a split, computed
once before training and looked up per batch (8 bytes per pair instead of a model).
"""
import logging

import numpy as np
import torch

from model import lora, objectives
from parallel import comm, memory, passes, precision


def setup(config, mesh, ops, policy, loaders, starting_model):
  """The frozen copy the steps use as reference, or None. With LoRA the reference is the
  base (adapters off: no memory); else `starting_model()` (the init_from weights, also on
  resume), or with dpo.precompute_ref_log_probs that copy's log-probs of every pair of the
  loaders' splits, attached to their batches, the copy then dropped."""
  copy = starting_model() if lora.settings(config.model) is None else None
  if not config.model_alignment_strategy.dpo.precompute_ref_log_probs:
    if copy is not None:
      logging.info('DPO reference: a frozen copy of the starting model, %s on this rank',
                   memory.human_bytes(sum(p.numel() * p.element_size() for p in copy.values())))
    return copy
  for loader in loaders:
    loader.ref_logps = precompute(loader, params(policy, copy), config, mesh, ops)
    logging.info('DPO reference: log-probs of %d %s pairs precomputed (%s)', len(loader.ref_logps), loader.split,
                 memory.human_bytes(loader.ref_logps.numel() * loader.ref_logps.element_size()))
  return None


def params(policy, frozen_copy):
  """The reference model's parameters on this rank."""
  if frozen_copy is not None:
    return frozen_copy
  return {n: p for n, p in policy.items() if not lora.is_adapter(n)}


def precompute(loader, ref_params, config, mesh, ops):
  """[rows, 2] (CPU) reference log-probs of every row of `loader`'s split, in global batches
  whose DP slices each rank computes; exact on last-stage ranks (the only ones that read them)."""
  source, recipe = loader.source, precision.recipe(config.precision)
  objective = objectives.for_config(config)
  rows = source.samples_per_epoch
  table = torch.zeros(rows, 2, dtype=torch.float32, device=mesh.device)
  gbs, mbs = config.data.global_batch_size, config.data.micro_batch_size
  per_rank = gbs // mesh.dp
  for start in range(0, rows, gbs):
    mine = np.arange(start + mesh.dp_rank * per_rank, start + (mesh.dp_rank + 1) * per_rank)
    ids = [mine[i:i + mbs] for i in range(0, per_rank, mbs)]
    batches = [{k: torch.from_numpy(v).to(mesh.device) for k, v in source.rows.batch(np.minimum(r, rows - 1)).items()}
               for r in ids]
    for r, ref in zip(ids, passes.forward_outputs(ref_params, batches, config, mesh, ops, objective.reference, recipe)):
      if ref is not None and (r < rows).any():
        table[r[r < rows]] = ref[torch.from_numpy(r < rows).to(ref.device)].float()
  return comm.all_reduce_(table, mesh.dp_group, name='all_reduce(reference log-probs over dp)').cpu()
