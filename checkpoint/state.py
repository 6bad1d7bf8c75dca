"""Training state <-> checkpoint arrays: global names, logical shapes and every rank's box.

Arrays (each stored once, in its global logical shape; vocab tables unpadded):
  <param name>               parameters, e.g. layers.3.mlp.up_proj.weight
  master.<param name>        fp32 master weights (only where parameters are bf16 and the recipe
                             keeps masters: mixed_precision)
  optim.<key>.<param name>   optimizer state tensors (exp_avg, exp_avg_sq, ...)
The box of each array that a rank holds is a pure function of (config, mesh, rank), so every
rank computes the whole layout and a checkpoint written at one layout loads at any other:
each rank reads the boxes its current layout needs.
"""
import dataclasses
import json

from ml_collections import config_dict
import torch

from checkpoint import steps as checkpoint_steps, storage, store
from model import hf, lora, param_table
from optim import optimizers
from parallel import device as devices, experts, param_shards, pipeline, tensor, zero


def _rank_mesh(mesh, rank):
  return dataclasses.replace(mesh, rank=rank)


def _clip(name, box, model_cfg):
  """A box clipped to the unpadded vocabulary; None when nothing is left."""
  if name in tensor.VOCAB_TABLES:
    rows = box[0]
    box = (slice(min(rows.start, model_cfg.vocab_size), min(rows.stop, model_cfg.vocab_size)),) + box[1:]
  return box if all(sl.stop > sl.start for sl in box) else None


def logical_shape(name, spec, model_cfg):
  if name in tensor.VOCAB_TABLES:
    return (model_cfg.vocab_size,) + tuple(spec.shape[1:])
  return tuple(spec.shape)


def param_boxes(config, mesh, rank):
  """name -> this rank's (unclipped) box of every parameter its pipeline stage holds."""
  mesh_r = _rank_mesh(mesh, rank)
  return tensor.boxes(config.model, mesh_r, pipeline.config_owned_names(config, mesh_r))


def _shard_box(name, box, local_rows, config, mesh, rank):
  """The optimizer-state box: the parameter box narrowed to this rank's ZeRO rows (MoE experts
  under expert parallelism: shards over the DP ranks holding the same experts)."""
  mesh_r = _rank_mesh(mesh, rank)
  _, parts, index = experts.domain(mesh_r, name, config.distributed_strategy.zero1 and mesh.dp_cp > 1)
  rows, _ = zero.shard_rows(local_rows, parts, index)
  start = box[0].start
  return (slice(start + rows.start, start + rows.stop),) + tuple(box[1:])


def step_metadata(config, mesh, consumed_samples, state_keys, optimizer_step, **extra) -> dict:
  """What a step's metadata.json records besides its arrays (the data position, the config,
  the layout it was saved at, the optimizer's state keys and step)."""
  strategy = config.distributed_strategy
  return {'consumed_samples': consumed_samples, 'config': json.loads(config.to_json_best_effort()),
          'layout': {'dp': mesh.dp, 'pp': mesh.pp, 'tp': mesh.tp, 'cp': mesh.cp,
                     **({'ep': mesh.ep} if mesh.ep > 1 else {}),
                     'vp': strategy.virtual_pipeline_model_parallel_size, 'zero1': strategy.zero1,
                     **({'zero_stage': strategy.zero_stage} if strategy.zero1 and strategy.get('zero_stage', 1) > 1 else {}),
                     **({'dp_shard': mesh.shard_size} if mesh.shard_size < mesh.dp_cp else {})},
          'optimizer_state_keys': list(state_keys), 'optimizer_step': optimizer_step, **extra}


class StateLayout:
  """Every array's logical shape, dtype and per-rank boxes for one (config, mesh)."""

  def __init__(self, config, mesh, updater, state_keys=None, names=None, weights_only=False):
    """`state_keys`: optimizer state tensors to include (default: what the optimizer holds;
    on resume, what the checkpoint holds); `names`: the parameters to include (default: what
    a step of this run stores, lora.stored). Masters and optimizer state are those of the
    trained parameters (none for a merged LoRA model, nor with `weights_only`)."""
    self.config, self.mesh, self.updater = config, mesh, updater
    self.specs = param_table.param_specs(config.model, mesh.tp)
    self.all_boxes = [param_boxes(config, mesh, r) for r in range(mesh.world_size)]
    self.state_keys = list(state_keys) if state_keys is not None else updater.state_keys()
    self.names = list(names) if names is not None else lora.stored(config.model, self.specs)
    peft = lora.settings(config.model)
    self.merged = peft is not None and peft.merge_lora
    self.trained = [] if self.merged or weights_only else lora.trainable(config.model, self.specs)
    # ZeRO-3: a rank holds, saves and loads only its owned rows of each parameter
    self.params_kind = 'shard' if param_shards.shards_of(updater.params) is not None else 'param'

  def _param_dtype(self, name):
    return lora.param_dtype(name, self.updater.recipe.param_dtype)

  def _dtype(self, array):
    """Identical on every rank: parameters in their dtype (the recipe's; LoRA adapters fp32),
    masters fp32, optimizer state in the recipe's state dtype (bf16SR: bf16)."""
    if array.startswith('master.'):
      return 'float32'
    if array.startswith('optim.'):
      param = array.split('.', 2)[2]
      return str(self.updater.recipe.state_dtype(self._param_dtype(param))).removeprefix('torch.')
    return str(self._param_dtype(array)).removeprefix('torch.')

  def _arrays(self):
    """(array name, param name, kind) for every array of the checkpoint."""
    out = [(n, n, self.params_kind) for n in self.names]
    out += [(f'master.{n}', n, 'shard') for n in self.trained if self.updater.recipe.has_master(self._param_dtype(n))]
    optim = self.config.model.optim.name
    out += [(f'optim.{k}.{n}', n, 'shard') for k in self.state_keys for n in self.trained
            if optimizers.holds_state(optim, k, n, len(self.specs[n].shape))]
    return out

  def _box(self, param, kind, rank):
    box = self.all_boxes[rank].get(param)
    if box is None:
      return None
    if kind == 'shard':
      box = _shard_box(param, box, box[0].stop - box[0].start, self.config, self.mesh, rank)
    return _clip(param, box, self.config.model)

  def layouts(self):
    m = self.config.model
    return {array: store.ArrayLayout.from_boxes(
        logical_shape(param, self.specs[param], m), self._dtype(array),
        [self._box(param, kind, r) for r in range(self.mesh.world_size)])
        for array, param, kind in self._arrays()}

  def requests(self):
    """array -> the box this rank reads (its current layout)."""
    out = {}
    for array, param, kind in self._arrays():
      box = self._box(param, kind, self.mesh.rank)
      if box is not None:
        out[array] = box
    return out

  def local_tensors(self):
    """array -> this rank's tensor, clipped to the unpadded vocabulary."""
    shards = param_shards.shards_of(self.updater.params)
    params = dict(shards.shard) if shards is not None else {n: p.detach() for n, p in self.updater.params.items()}
    tensors = lora.merged(params, self.config.model) if self.merged else params
    if not self.merged:
      tensors.update(self.updater.named_state(self.state_keys))
    if self.mesh.device.type == 'xla':
      # One batched transfer of whole tensors; clipping them on the device would compile a graph.
      tensors = devices.to_host(tensors)
    out = {}
    for array, param, kind in self._arrays():
      box = self._box(param, kind, self.mesh.rank)
      if array in tensors and box is not None:
        out[array] = tensors[array][:box[0].stop - box[0].start]
    return out

  def restore(self, arrays, optimizer_step, weights_only=False, params=None):
    """Copy loaded boxes into parameters, then masters and optimizer state (`params`: other
    tensors of the same boxes to load weights into, leaving the updater alone)."""
    u = self.updater
    shards = param_shards.shards_of(params if params is not None else u.params)
    targets = shards.shard if shards is not None else params if params is not None else u.params
    with torch.no_grad():
      for name, p in targets.items():
        if name in arrays:
          p[:arrays[name].shape[0]].copy_(arrays[name])
    if params is not None:
      return
    u.refresh_masters()
    if not weights_only:
      u.load_named_state({a: v for a, v in arrays.items() if a.startswith(('master.', 'optim.'))},
                         optimizer_step)


def resolve_step(path):
  """A step directory: `path` itself (a committed step, or an HF model directory), or the
  newest committed step of a checkpoint directory."""
  if checkpoint_steps.is_committed(path) or hf.is_hf_dir(path):
    return path
  steps = checkpoint_steps.committed_dirs(path)      # any naming (exp_manager.checkpoint_callback_params.filename)
  if not steps:
    raise store.CheckpointError(f'{path} is neither an HF model directory, nor a committed checkpoint '
                                'step, nor a directory holding committed steps')
  return storage.join(path, steps[max(steps)])


def read_model(path):
  """(config, whole parameters) of checkpoint step `path` (or the newest step under it) on
  one process, vocab rows padded
  as the model's. A LoRA step holding adapters only gets its base from the run's
  exp_manager.init_from (an HF directory or a flatron step); a merged step is a plain model."""
  path = resolve_step(path)
  meta = checkpoint_steps.read_metadata(path)
  config = config_dict.ConfigDict(meta['config'])
  stored = meta.get('lora', {}).get('stored', 'all')
  if stored == 'merged':
    config.model.peft.lora_rank = 0
  specs = param_table.param_specs(config.model)
  in_step = [n for n in specs if n in meta.get('arrays', {})]
  arrays = store.load_arrays(path, {n: tuple(slice(0, k) for k in logical_shape(n, specs[n], config.model))
                                    for n in in_step})
  params = {}
  if stored == 'adapters':
    base = config.exp_manager.init_from
    if not base:
      raise store.CheckpointError(f'{path} holds LoRA adapters only and its run names no init_from base')
    params = dict(hf.load_hf(base, config.model)[1] if hf.is_hf_dir(base) else read_model(base)[1])
  for name in in_step:
    value = arrays[name]
    if value.shape != specs[name].shape:                # re-pad the vocabulary rows
      padded = torch.zeros(specs[name].shape, dtype=value.dtype)
      padded[:value.shape[0]] = value
      value = padded
    params[name] = value
  return config, params
