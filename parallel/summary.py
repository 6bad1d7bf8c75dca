"""The start-up summary: the layout, parameter counts, FLOPs per token, the batch, the memory
estimate per rank and bytes per parameter, and what LoRA trains. One text for the training log
(and, with the planner, for --dry_run).
"""
from model import lora, transformer
from parallel import memory, tensor


def startup(config, mesh, sizes, est) -> str:
  """The start-up summary of `config` on this rank of `mesh`: `sizes` (name -> elements of each
  parameter box it holds) and `est` (memory.estimate's components)."""
  m, a = config.model, config.data
  n_total, n_nonembed = transformer.count_params(m), transformer.count_params(m, embedding=False)
  tokens_per_step = a.global_batch_size * a.seq_length
  accum = a.global_batch_size // (a.micro_batch_size * mesh.dp)
  sp = ' +sp' if config.distributed_strategy.sequence_parallel else ''
  lines = [
      f'flatron | {config.name} | {mesh.world_size} process(es) on {mesh.device.type}: '
      f'dp={mesh.dp} x pp={mesh.pp} x tp={mesh.tp}{sp}',
      f'params {n_total:,} ({n_nonembed:,} non-embedding), {sum(sizes.values()):,} on this rank | FLOPs/token '
      f'{transformer.flops_per_token(m, a.seq_length):.3e} (6N + 12Lhs' + (', frozen base 4N' if lora.settings(m) else '') + ')',
      f'batch: global {a.global_batch_size} x seq {a.seq_length} = {tokens_per_step:,} tokens/step | '
      f'micro {a.micro_batch_size} x {accum} accumulation steps x dp {mesh.dp}',
      'memory/rank (estimate): ' + ' | '.join(f'{k} {memory.human_bytes(v)}' for k, v in est.items()),
      f'precision {config.precision.type}: {memory.state_bytes_per_param(est, sizes):.1f} bytes/param on this rank '
      '(params + grads + master + optimizer state)',
  ]
  if lora.settings(m) is not None:
    lines.append(_lora_line(config, sizes, est, n_total))
  if mesh.world_size > 1:
    lines += ['layout:'] + ['  ' + line for line in tensor.describe_layout(config, mesh)]
  return '\n'.join(lines)


def _lora_line(config, sizes, est, n_total) -> str:
  """The adapters' settings (as resolved: the starting adapter's where the run left them unset)
  and what trains."""
  m = config.model
  peft = lora.settings(m)
  trained = transformer.count_params(m, trainable_only=True)
  patterns = ' with rank/alpha patterns' if peft.get('rank_pattern') or peft.get('alpha_pattern') else ''
  source = f' (from {lora.adapter_source(peft)})' if peft.load_lora_from_ckpt else ''
  return (f'LoRA r={peft.lora_rank} alpha={lora.option(peft, "lora_alpha"):g}'
          f'{" (rsLoRA)" if lora.option(peft, "use_rslora") else ""}{patterns} dropout='
          f'{lora.option(peft, "lora_dropout"):g} bias={lora.option(peft, "lora_bias")}{source} on '
          f'{len(lora.plan(m, transformer.param_specs(m, adapters=False)))} linears '
          f'({", ".join(lora.target_modules(peft))}): '
          f'trainable {trained:,} of {n_total:,} ({100 * trained / n_total:.3f}%), '
          f'{memory.param_counts(config, sizes)["trainable"]:,} on this rank; optimizer state '
          f'{memory.human_bytes(est["optimizer"] + est["master"])} per rank; the base is frozen')
