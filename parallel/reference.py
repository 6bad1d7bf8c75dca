"""DPO's reference model on the mesh: which parameters it is, and its log-probs of each pair,
computed through the same pipeline (forward only) as the policy.

The reference is the starting model. With LoRA it is the policy's own base with the adapters
switched off (the same tensors: no memory); without, a frozen copy sharded like the policy,
or (dpo.precompute_ref_log_probs) that copy's log-probs of every row of a split, computed
once before training and looked up per batch (8 bytes per pair instead of a model).
"""
import numpy as np
import torch

from model import lora, objectives, transformer
from parallel import comm, pipeline, precision


def params(policy, frozen_copy):
  """The reference model's parameters on this rank."""
  if frozen_copy is not None:
    return frozen_copy
  return {n: p for n, p in policy.items() if not lora.is_adapter(n)}


@torch.no_grad()
def logps(ref_params, batches, config, mesh, ops, objective, recipe):
  """[b, 2] reference log-probs of each micro batch's pairs on last-stage ranks (None on
  the others): a forward-only pass through the pipeline."""
  m = config.model
  bounds = pipeline.config_bounds(config, mesh.pp)
  last = len(bounds) - 1
  out = [None] * len(batches)

  def stage_fn(i, chunk, x):
    vs = chunk * mesh.pp + mesh.pp_rank
    with precision.compute_context(recipe, mesh.device.type):
      result = transformer.stage(ref_params, batches[i], m, ops, layer_range=bounds[vs], x_bsh=x,
                                 last=vs == last, objective=objective.reference)
    if vs != last:
      return result
    out[i] = result[0].detach()
    return None

  shape = (config.data.micro_batch_size, config.data.seq_length // ops.residual_slices, m.hidden_size)
  pipeline.run_forward_only(len(batches), stage_fn, mesh, config.distributed_strategy.virtual_pipeline_model_parallel_size,
                            shape, recipe.param_dtype)
  return out


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
    for r, ref in zip(ids, logps(ref_params, batches, config, mesh, ops, objective, recipe)):
      if ref is not None and (r < rows).any():
        table[r[r < rows]] = ref[torch.from_numpy(r < rows).to(ref.device)].float()
  return comm.all_reduce_(table, mesh.dp_group, name='all_reduce(reference log-probs over dp)').cpu()
