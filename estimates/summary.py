"""The start-up summary: the layout, parameter counts, FLOPs per token, the batch, the memory
estimate per rank and bytes per parameter, the predicted step time (estimates/step_time.py, the
model tools/plan.py searches with), and what LoRA trains. One text for the training log and
--dry_run.
"""
import dataclasses

import torch

from estimates import clusters, memory, memory_check, step_time
from model import flop_count, lora, lora_targets, param_init, param_table, transformer
from parallel import device as devices, experts, mesh as meshes, tensor, training


def startup(config, mesh, sizes, est) -> str:
  """The start-up summary of `config` on this rank of `mesh`: `sizes` (name -> elements of each
  parameter box it holds) and `est` (memory.estimate's components)."""
  m, a = config.model, config.data
  n_total, n_nonembed = param_table.count_params(m), param_table.count_params(m, embedding=False)
  tokens_per_step = a.global_batch_size * a.seq_length
  accum = a.global_batch_size // (a.micro_batch_size * mesh.dp)
  sp = ' +sp' if config.distributed_strategy.sequence_parallel and mesh.tp > 1 else ''
  lines = [
      f'flatron | {config.name} | {mesh.world_size} process(es) on {mesh.device.type}: '
      f'dp={mesh.dp} x pp={mesh.pp}' + (f' x cp={mesh.cp} (ring attention)' if mesh.cp > 1 else '')
      + f' x tp={mesh.tp}{sp}' + (f' | ep={mesh.ep} (experts over dp)' if mesh.ep > 1 else ''),
      f'model {m.num_layers} layers x hidden {m.hidden_size} | heads {m.num_attention_heads} (kv '
      f'{param_table.kv_heads(m)}) x head_dim {transformer.head_dim(m)} | ffn {m.ffn_hidden_size} | vocab '
      f'{m.vocab_size} (padded {param_table.padded_vocab_size(m, mesh.tp)})'
      + (f' | from {m.model_config} + {len(m.model_config_overrides)} key(s) set over it' if config.model_source == 'hf' else ''),
      f'params {n_total:,} ({n_nonembed:,} non-embedding), {sum(sizes.values()):,} on this rank | FLOPs/token '
      f'{flop_count.flops_per_token(m, a.seq_length):.3e} (6N + 12 x heads x head_dim x span, summed over layers' + (', frozen base 4N' if lora.settings(m) else '') + ')',
      f'batch: global {a.global_batch_size} x seq {a.seq_length} = {tokens_per_step:,} tokens/step | '
      f'micro {a.micro_batch_size} x {accum} accumulation steps x dp {mesh.dp}'
      + (f' | cp {mesh.cp}: {a.seq_length // mesh.cp:,} tokens of each sequence per rank (activations / {mesh.cp})'
         if mesh.cp > 1 else ''),
      'memory/rank (estimate): ' + ' | '.join(f'{k} {memory.human_bytes(v)}' for k, v in memory.components(est).items()
                                              if v),
      f'memory/rank peak (estimate): {memory.human_bytes(est["total"])} in {est["peak_phase"]} | '
      + ' | '.join(f'{k} {memory.human_bytes(v)}' for k, v in est['phases'].items()),
      step_line(config, mesh),
      f'precision {config.precision.type}: {memory.state_bytes_per_param(est, sizes):.1f} bytes/param on this rank '
      '(params + grads + master + optimizer state)',
  ]
  if m.compile:
    lines.append('model.compile: each transformer block runs through torch.compile (one graph serves every '
                 'layer); the first step includes compiling it')
  if lora.settings(m) is not None:
    lines.append(_lora_line(config, sizes, est, n_total))
  if mesh.world_size > 1:
    lines += ['layout:'] + ['  ' + line for line in describe_layout(config, mesh)]
  return '\n'.join(lines)


def plan_cluster(config, device):
  """The cluster trainer.plan_cluster names (auto: `local` on CPU, by GPU name on CUDA, none
  on XLA, whose chips torch cannot name), or None."""
  name = config.trainer.get('plan_cluster', 'auto')
  if name == 'none':
    return None
  if name != 'auto':
    return clusters.get(name)
  if device.type == 'cpu':     # a local device is one thread's worth (--calibrate): a process has n
    # (its rates scale with the threads; the framework's overhead, one Python thread's, does not)
    local, n = clusters.local(), torch.get_num_threads()
    return dataclasses.replace(local, peak={k: v * n for k, v in local.peak.items()}, mem_bw=local.mem_bw * n,
                               ew_bw=local.ew_bw * n, logit_s=local.logit_s / n)
  if device.type == 'cuda':
    gpu = torch.cuda.get_device_name(device) if torch.cuda.is_available() else ''
    return next((clusters.CLUSTERS[k] for k in ('h100', 'a100') if k.upper() in gpu), None)
  return None


def step_line(config, mesh) -> str:
  """The predicted step time of this layout (estimates/step_time.py, the planner's model)."""
  cluster = plan_cluster(config, mesh.device)
  if cluster is None:
    return ('step time (predicted): no cluster for this device; set trainer.plan_cluster '
            f'(one of {", ".join(clusters.names())})')
  p = step_time.predict(config, cluster, mesh.world_size)
  return f'step time (predicted on {on_cluster(cluster, mesh.world_size)}): {p.line()} | python -m tools.plan ranks the other layouts'


def on_cluster(cluster, world_size) -> str:
  """'1,024 devices, 32 trn1.32xlarge nodes': a cluster entry is a node type, so its count is nodes."""
  nodes = -(-world_size // cluster.devices_per_node)
  return (f'{world_size:,} device{"s" if world_size != 1 else ""}, '
          f'{nodes:,} {cluster.name} node{"s" if nodes != 1 else ""}')


def _lora_line(config, sizes, est, n_total) -> str:
  """The adapters' settings (as resolved: the starting adapter's where the run left them unset)
  and what trains."""
  m = config.model
  peft = lora.settings(m)
  trained = param_table.count_params(m, trainable_only=True)
  patterns = ' with rank/alpha patterns' if peft.get('rank_pattern') or peft.get('alpha_pattern') else ''
  source = f' (from {lora.adapter_source(peft)})' if peft.load_lora_from_ckpt else ''
  return (f'LoRA r={peft.lora_rank} alpha={lora.option(peft, "lora_alpha"):g}'
          f'{" (rsLoRA)" if lora.option(peft, "use_rslora") else ""}{patterns} dropout='
          f'{lora.option(peft, "lora_dropout"):g} bias={lora.option(peft, "lora_bias")}{source} on '
          f'{len(lora_targets.plan(m, param_table.param_specs(m, adapters=False)))} linears '
          f'({", ".join(lora_targets.target_modules(peft))}): '
          f'trainable {trained:,} of {n_total:,} ({100 * trained / n_total:.3f}%), '
          f'{memory.param_counts(config, sizes)["trainable"]:,} on this rank; optimizer state '
          f'{memory.human_bytes(est["optimizer"] + est["master"])} per rank; the base is frozen')


def dry_run(config, world_size, check) -> str:
  """What --dry_run prints after the config resolved and validated (dry_run_report's text)."""
  return dry_run_report(config, world_size, check)[0]


def dry_run_report(config, world_size, check):
  """(text, refusal): the config and rank 0's start-up summary at `world_size` processes with the
  memory estimate and whether it fits: a device of the cluster trainer.plan_cluster names, else
  this machine (`check`: configs.validate.check, for the layouts that would). `refusal` is the
  error when the run does not fit the named cluster's device (None otherwise: this machine is
  only reported on, as a run planned elsewhere may well not fit it)."""
  d = config.distributed_strategy
  tp, pp, cp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.context_parallel_size
  mesh = meshes.Mesh(dp=world_size // (tp * pp * cp), pp=pp, tp=tp, cp=cp, kv_replicator=d.kv_replicator,
                     ep=d.get('expert_model_parallel_size', 1), device=torch.device(devices.kind(config.device)))
  sizes = training.local_sizes(config, mesh)
  target, refusal = memory_check.target_bytes(config), None
  if target is None:
    est = memory.estimate(config, sizes, mesh.dp)
  else:                  # as the named cluster's devices run it (its attention kernels), no CPU heap
    there = config.copy_and_resolve_references()
    there.device = plan_cluster(config, mesh.device).device
    est = memory.on_another_device(memory.estimate(there, sizes, mesh.dp))
  try:
    memory_check.check_fits(config, mesh, est, check, target)
    if target is None:
      fits = f'memory: fits a {mesh.device.type} rank of this machine (or the check is off)'
    else:
      need, (budget, what) = est['total'], target
      fits = (f'memory: {"fits" if need <= budget else "does not fit"} {what}: {memory.human_bytes(need)} of '
              f'{memory.human_bytes(budget)}' + ('' if need <= budget else ' (trainer.memory_check=False: not refused)'))
  except MemoryError as e:
    refusal = f'does not fit {target[1]}: {e}' if target else None
    fits = f'memory: {refusal}' if target else f'memory: would be refused here: {e}'
  text = '\n'.join(['resolved flatron config:', config.to_yaml().rstrip(), '', startup(config, mesh, sizes, est), fits,
                    'dry run: nothing was allocated and the workdir was not touched'])
  return text, refusal


def describe_layout(config, mesh):
  """One line per rank: its mesh coordinates and which heads / ffn columns / vocab rows it holds."""
  m = config.model
  specs = param_table.param_specs(m, mesh.tp)
  d = transformer.head_dim(m)

  def span(name, t, divisor=1):
    rows = tensor.tp_box(specs[name], mesh.tp, t, mesh.kv_replicator)[0]
    return f'{rows.start // divisor}-{rows.stop // divisor - 1}'

  def ffn(r):
    if 'layers.0.mlp.up_proj.weight' in specs:
      return f'ffn {span("layers.0.mlp.up_proj.weight", r.tp_rank)}'
    name = 'layers.0.mlp.experts.down_proj'       # MoE: the experts this rank holds
    rows = experts.ep_box(name, param_init.full_box(specs[name].shape), specs[name], r)[0]
    return f'experts {rows.start}-{rows.stop - 1}'

  def heads(r):
    q, k = 'layers.0.self_attn.q_proj.weight', 'layers.0.self_attn.k_proj.weight'
    if q not in specs or k not in specs:   # latent attention (kv_b_proj's rows), or a fork's own: heads split evenly
      per = m.num_attention_heads // mesh.tp
      return f'heads {r.tp_rank * per}-{(r.tp_rank + 1) * per - 1}'
    return f'q heads {span(q, r.tp_rank, d)}, kv heads {span(k, r.tp_rank, d)}'

  ranks = [dataclasses.replace(mesh, rank=r) for r in range(mesh.world_size)]
  return [f'rank {r.rank}: dp {r.dp_rank} pp {r.pp_rank}{f" cp {r.cp_rank}" if r.cp > 1 else ""} tp {r.tp_rank} | '
          f'{heads(r)}, {ffn(r)}, vocab rows {span("embed_tokens.weight", r.tp_rank)}'
          for r in ranks]
