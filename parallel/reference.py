"""DPO's reference model on the mesh: which parameters it is, and its log-probs of each pair,
computed through the same pipeline (forward only) as the policy.

The reference is the starting model (dpo.reference_model=start). With LoRA it is the
policy's own base (the same tensors: no memory) with the adapters the run started from: a
frozen copy of load_lora_from_ckpt's adapters (as trl keeps a copy of a loaded adapter), or
none when the adapters start at B = 0. dpo.reference_model=base takes the base with the
adapters off even then. Without LoRA it is a frozen copy sharded like the policy. With
dpo.precompute_ref_log_probs, the reference's log-probs of every row of a split are computed
once before training and looked up per batch (8 bytes per pair; the copy is then dropped).
"""
import logging

import numpy as np
import torch

from model import lora, objectives
from numerics import precision
from parallel import comm, passes


def _mib(nbytes):
  return f'{nbytes / 2**20:.1f} MiB'


def setup(config, mesh, ops, policy, loaders, starting_model, starting_adapters):
  """The frozen copy the steps use as reference (objectives.reference_copy), or None:
  `starting_model()` (the init_from weights) or `starting_adapters()` (load_lora_from_ckpt's),
  read again on resume; with dpo.precompute_ref_log_probs the reference's log-probs of every
  pair of the loaders' splits are attached to their batches instead, and the copy dropped."""
  part = objectives.reference_copy(config)
  copy = starting_model() if part == 'model' else starting_adapters() if part == 'adapters' else None
  if not config.model_alignment_strategy.dpo.precompute_ref_log_probs:
    if copy is not None:
      logging.info('DPO reference: a frozen copy of the starting %s, %s on this rank', part,
                   _mib(sum(p.numel() * p.element_size() for p in copy.values())))
    return copy
  for loader in loaders:
    loader.ref_logps = precompute(loader, params(policy, copy), config, mesh, ops)
    logging.info('DPO reference: log-probs of %d %s pairs precomputed (%s)', len(loader.ref_logps), loader.split,
                 _mib(loader.ref_logps.numel() * loader.ref_logps.element_size()))
  return None


def params(policy, frozen_copy):
  """The reference model's parameters on this rank: the frozen copy of the whole model, or the
  policy's base with the frozen copy of the starting adapters (and trained biases), or none."""
  if frozen_copy is not None and frozen_copy.keys() == policy.keys():
    return frozen_copy
  return dict({n: p for n, p in policy.items() if not lora.is_adapter(n)}, **(frozen_copy or {}))


def precompute(loader, ref_params, config, mesh, ops):
  """[rows, 2] (CPU) reference log-probs of every row of `loader`'s split, in global batches
  whose DP slices each rank computes; exact on last-stage ranks (the only ones that read them)."""
  source, recipe = loader.source, precision.recipe(config.precision)
  objective = objectives.for_config(config)
  rows = source.samples_per_epoch
  table = torch.zeros(rows, 2, dtype=torch.float32, device=mesh.device)
  gbs, mbs = config.data.global_batch_size, config.data.micro_batch_size
  per_rank = gbs // mesh.dp
  rows_of = lambda r: {k: torch.from_numpy(v) for k, v in source.rows.batch(np.minimum(r, rows - 1)).items()}
  for start in range(0, rows, gbs):
    mine = np.arange(start + mesh.dp_rank * per_rank, start + (mesh.dp_rank + 1) * per_rank)
    ids = [mine[i:i + mbs] for i in range(0, per_rank, mbs)]
    # each cp rank's slice of the rows (the log-probs come back summed over cp: ops.row_sum)
    batches = [passes.model_batch(rows_of(r), mesh) for r in ids]
    for r, ref in zip(ids, passes.forward_outputs(ref_params, batches, config, mesh, ops, objective.reference, recipe)):
      if ref is not None and (r < rows).any():
        table[r[r < rows]] = ref[torch.from_numpy(r < rows).to(ref.device)].float()
  return comm.all_reduce_(table, mesh.dp_group, name='all_reduce(reference log-probs over dp)').cpu()
