"""The traced dry run (`--dry_run=trace`): one rank of the target layout runs the real training
step on fake tensors against the fake process-group backend, and its live bytes are counted.

For each rank traced, in this one process and without allocating the model: torch.distributed
starts with the `fake` backend as rank r of the target world (collectives return at once),
the mesh builds every group of the layout, and under FakeTensorMode (tensors with shapes,
dtypes and devices, no storage) the rank's parameters, optimizer state, gradient buckets and
stand-in micro batches (data/stand_in.py) are made at their real shapes. Then STEPS real
training steps run (forward and backward through the pipeline schedule, the gradient
reduction, the clip and the optimizer, ZeRO-1's gathers, the logging) while
estimates/live_bytes.py counts every tensor's storage; the second step's peak is the one
reported (the first makes the optimizer's state). Its parts are set beside the estimate's
(estimates/memory.py) at the estimate's peak phase.

What it proves: every shape, collective and group of this rank's step at the target size, and
the bytes its tensors hold. What it cannot see: time, the kernels' own workspaces, the
allocator's fragmentation and the runtime's memory (those come from the estimate), nor a
value-dependent path (host_values.py: each assumption is listed by name).

The fake tensors carry the CPU's device type, so the step takes the eager path (CPU, CUDA):
XLA's whole-step graph (fixed expert buffers, no overlapped gathers) is traced as such only
where the config asks for it (model.moe.fixed_buffers).
"""
import copy
import math
import os
import sys
import time
import traceback

import torch
from absl import logging as absl_logging

import host_values
import logs
from data import stand_in
from estimates import activations, live_bytes, memory
from model import flop_count, lora, moe, objectives
from optim import update
from parallel import mesh as meshes, param_shards, tensor, training
from user_errors import UserError

STEPS = 2                   # the first makes the optimizer state; the second is the steady step
ROOT = os.path.dirname(os.path.abspath(__file__))
# the estimate's components each traced category is set against
COMPARED = {'params': ('params', 'reference', 'gathered'), 'master': ('master',), 'optimizer': ('optimizer',),
            'grads': ('grads',), 'activations': ('activations', 'logits'),
            'transients': ('grad_transient', 'reduction', 'update_temporaries')}


class TraceError(UserError, RuntimeError):
  """The traced step failed: one line naming the rank, its layout and the failing operation."""


def ranks(mesh) -> list:
  """The ranks whose programs differ: the first and the last pipeline stage (the most
  activations in flight; the head and the loss), each at the first and last cp rank (the
  ring's causal blocks differ). TP, DP and EP ranks run the same shapes."""
  stages = sorted({0, mesh.pp - 1})
  cps = sorted({0, mesh.cp - 1})
  return [mesh.rank_of(pp_rank=p, cp_rank=c) for p in stages for c in cps]


def trace_rank(config, world_size, rank, all_micro_batches=False) -> dict:
  """Trace rank `rank` of `world_size`: {'rank', 'where' (its layout coordinates), 'peak' and
  'at_peak' (bytes by category, live_bytes), 'estimate' (memory.estimate of this rank's
  tensors), 'assumed' (host_values' assumptions), 'seconds'}. Each step runs `schedule_micro_batches`
  of the step's micro batches, or with `all_micro_batches` all of them."""
  cfg = copy.deepcopy(config)
  with cfg.unlocked():
    cfg.backend = 'fake'
  layout = meshes.layout(cfg, world_size, rank)
  # the estimate of the device the config names (its runtime, its collectives' buffers)
  est = memory.estimate(cfg, training.local_sizes(cfg, layout), layout.dp, layout.pp_rank)
  # the experts in fixed-size buffers where the target runs them so (XLA, model.compile): its program
  buffered = moe.enabled(cfg.model) and activations.fixed_buffers(cfg) and not cfg.model.moe.get('fixed_buffers')
  with cfg.unlocked():
    cfg.device = 'cpu'
    compiled = cfg.model.get('compile')
    cfg.model.compile = False       # dynamo does not trace under the trace's dispatch modes
    if buffered:
      cfg.model.moe.fixed_buffers = True
  start = time.perf_counter()
  mesh, level = None, absl_logging.get_absl_logger().level    # restored as it was: set_verbosity would pin it
  absl_logging.set_verbosity(absl_logging.WARNING)    # the step's own lines (loss nan) say nothing here
  try:
    mesh = meshes.init(cfg, world=world_size, rank=rank)
    shortened = _shorten(cfg, mesh, all_micro_batches)
    loader = stand_in.loader(cfg, mesh.dp_rank, mesh.dp)
    gbs = cfg.data.global_batch_size
    batches = [loader.global_batch(step * gbs) for step in range(STEPS)]    # real, small: made before faking
    d = cfg.distributed_strategy     # the first step only makes the optimizer state: as few as the schedule takes
    batches[0] = batches[0][:d.pipeline_model_parallel_size if d.virtual_pipeline_model_parallel_size > 1 else 1]
    with live_bytes.FakeLiveBytes() as live, live.saving(), host_values.recording() as assumed:
      if compiled:
        host_values.note('model.compile: the blocks run eagerly (their eager temporaries)')
      if buffered:
        host_values.note('MoE: the experts run in fixed-size buffers (moe.fixed_buffers), as XLA and model.compile run them')
      if shortened:
        host_values.note(shortened)
      _steps(cfg, mesh, live, [[{k: live.from_tensor(v) for k, v in b.items()} for b in mbs] for mbs in batches])
  except Exception as e:  # pylint: disable=broad-except
    where = mesh.describe() if mesh is not None else f'rank {rank}/{world_size}'
    raise TraceError(f'trace of {where}: {failing_operation(e)}: {type(e).__name__}: '
                     f'{_first_line(e)}') from e
  finally:
    absl_logging.get_absl_logger().setLevel(level)
    meshes.shutdown()
  return {'rank': rank, 'where': mesh.describe(), 'peak': live.peak, 'at_peak': live.at_peak,
          'estimate': est, 'assumed': assumed, 'seconds': time.perf_counter() - start}


def schedule_micro_batches(config, dp) -> tuple:
  """(micro batches a traced step runs, the step's own): enough for the pipeline schedule's
  warm-up, one steady 1F1B round with every stage's micro batches in flight, and its cool-down:
  pp + 1, and under the interleaved schedule pp (vp + 1) (a multiple of pp, as it needs); at
  least 2 (the first micro batch's gradients are copied into the buckets, the later ones
  added). Every further micro batch repeats the steady phase's shapes and bytes."""
  d = config.distributed_strategy
  own = config.data.global_batch_size // (config.data.micro_batch_size * dp)
  pp, vp = d.pipeline_model_parallel_size, d.virtual_pipeline_model_parallel_size
  return min(own, max(2, pp * (vp + 1) if vp > 1 else pp + 1)), own


def _shorten(cfg, mesh, all_micro_batches):
  """Cut cfg's global batch to schedule_micro_batches' count; the note saying so, or None."""
  runs, own = schedule_micro_batches(cfg, mesh.dp)
  if all_micro_batches or runs == own:
    return None
  with cfg.unlocked():
    cfg.data.global_batch_size = runs * cfg.data.micro_batch_size * mesh.dp
  return (f'each step runs {runs} of its {own} micro batches (the pipeline schedule\'s warm-up, steady phase and '
          'cool-down; the others repeat the steady phase)')


def _steps(cfg, mesh, live, batches):
  """The loop's set-up and STEPS training steps (train.py's), on fake tensors."""
  params = training.init_params(cfg, mesh)
  shards = param_shards.shards_of(params)
  if shards is not None:        # ZeRO-3: the owned rows, and the boxes as they are gathered and freed
    shards.on_resize = live.resized
    live.hold(shards.shard.values(), 'params')
  live.hold(params.values(), 'params')
  updater = update.Updater(params, cfg, mesh, training.placement(cfg, mesh), trainable=lora.trainable(cfg.model, params))
  ops = tensor.config_ops(cfg, mesh)
  reference = _reference(cfg, mesh, params, updater, batches)
  if reference is not None:
    live.hold([t for n, t in reference.items() if t is not params.get(n)], 'params')
  reporter = logs.StepReporter(cfg, mesh, logs.MetricsLog(None, False, False), (1.0, 'trace'), STEPS, 0,
                               flop_count.flops_per_token(cfg.model, cfg.data.seq_length))
  consumed = 0
  for step, micro_batches in enumerate(batches):
    out = training.train_step(params, updater, micro_batches, cfg, step, mesh, ops, reference,
                              defer_param_gather=True, param_norm=cfg.exp_manager.log_parameter_norm)
    consumed += cfg.data.global_batch_size
    reporter.add(step, out, consumed)
    del out
    _classify(live, params, updater)
    if step == 0:
      live.restart_peak()
  updater.wait_params()
  reporter.flush()


def _reference(cfg, mesh, params, updater, batches):
  """DPO's reference as the loop sets it up: precomputed log-probs on the batches, or the frozen
  copy of the starting model or adapters (objectives.reference_copy), or the base itself."""
  if objectives.for_config(cfg).reference is None:
    return None
  if cfg.model_alignment_strategy.dpo.precompute_ref_log_probs:
    for micro_batches in batches:
      for mb in micro_batches:
        mb['ref_logps'] = torch.zeros(mb['tokens'].shape[0], 2)
    return None
  part = objectives.reference_copy(cfg)
  copy_ = (training.init_params(cfg, mesh) if part == 'model'
           else training.init_params(cfg, mesh, set(updater.trainable)) if part == 'adapters' else None)
  from parallel import reference as references  # pylint: disable=import-outside-toplevel
  return references.params(params, copy_)


def _classify(live, params, updater):
  """After a step: what stays is the parameters, the masters, the optimizer's state and the
  gradient buckets (in this order of precedence: a master may be a view of its parameter)."""
  live.hold(live_bytes.tensors_in(updater.grads), 'grads')
  live.hold(live_bytes.tensors_in(updater.optimizer.state), 'optimizer')
  live.hold([m for n, m in updater.master.items() if updater.has_master_copy(n)], 'master')
  live.hold(params.values(), 'params')
  shards = param_shards.shards_of(params)
  if shards is not None:                 # ZeRO-3's owned rows
    live.hold(shards.shard.values(), 'params')


def failing_operation(error) -> str:
  """The innermost frame of flatron's own code in `error`'s traceback: file:line, function, source."""
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if f.filename.startswith(ROOT) and '/site-packages/' not in f.filename
            and os.path.basename(f.filename) not in ('step_trace.py', 'live_bytes.py', 'host_values.py')]
  if not frames:
    return 'in torch'
  f = frames[-1]
  return f'{os.path.relpath(f.filename, ROOT)}:{f.lineno} in {f.name}: {(f.line or "").strip()}'


def _first_line(error) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else '(no message)'


def trace(config, world_size, which=None, progress=None, all_micro_batches=False) -> list:
  """trace_rank for each rank of `which` (default: `ranks` of the layout); `progress(line)`
  hears of each as it finishes."""
  out = []
  for rank in (which if which is not None else ranks(meshes.layout(config, world_size))):
    out.append(trace_rank(config, world_size, rank, all_micro_batches))
    if progress:
      progress(f'traced {out[-1]["where"]}: peak {memory.human_bytes(out[-1]["peak"])} '
               f'in {out[-1]["seconds"]:.1f} s')
  return out


def tensor_estimate(est) -> dict:
  """`est` without what is not a tensor (the runtime, the CPU heap's holes): what a trace counts."""
  return memory._with_phases(dict(memory.components(est), runtime=0, heap_holes=0,  # pylint: disable=protected-access
                                  reduction_overlap=est.get('reduction_overlap', 0),
                                  logits_apart=est.get('logits_apart', 0)))


def compare(result) -> list:
  """[(category, traced bytes at the peak, estimated bytes at the estimate's peak phase)]: the
  estimate's activations and transients are those of its peak phase (memory._with_phases)."""
  est = tensor_estimate(result['estimate'])
  phase, overlap = est['peak_phase'], est['reduction_overlap']
  held = {c: sum(est.get(p, 0) for p in parts if p != 'gathered' or phase == 'forward_backward')  # ZeRO-3's passes
          for c, parts in COMPARED.items() if c not in ('activations', 'transients')}
  logits = est['logits'] - est['logits_apart']      # the logits' bytes beside the backward's working set
  made = {'forward_backward': (est['activations'] + logits, est['grad_transient']),
          'grad_reduction': (logits if overlap else 0, est['reduction'] + (est['grad_transient'] if overlap else 0)),
          'update': (0, est['update_temporaries'])}.get(phase, (0, 0))
  estimated = dict(held, activations=made[0], transients=made[1])
  return ([(c, result['at_peak'].get(c, 0), estimated[c]) for c in COMPARED]
          + [('total', result['peak'], est['total'])])


def off_by(traced, estimated) -> float:
  """(traced - estimated) / estimated, the trace's difference from the estimate."""
  return (traced - estimated) / estimated if estimated else math.inf if traced else 0.0


def report(results, budget=None, another_device=False) -> tuple:
  """(text, refusal): each traced rank's peak beside its estimate by category, the assumptions
  made, and the verdict against `budget` ((bytes, what), or None): the traced peak plus what
  the estimate adds beyond tensors (the runtime; the CPU heap's holes, unless the run is judged
  for `another_device`). `refusal` names the ranks over it."""
  lines, over = [], []
  for r in results:
    est, tensors = r['estimate'], tensor_estimate(r['estimate'])
    lines.append(f'traced {r["where"]} in {r["seconds"]:.1f} s: peak {memory.human_bytes(r["peak"])} of tensors, '
                 f'estimated {memory.human_bytes(tensors["total"])} ({100 * off_by(r["peak"], tensors["total"]):+.1f}%)')
    lines.append('  ' + ' | '.join(f'{c} {memory.human_bytes(t)} / {memory.human_bytes(e)}'
                                   for c, t, e in compare(r)[:-1] if t or e) + '   (traced / estimated)')
    lines += [f'  assumed: {what} ({times}x)' for what, times in sorted(r['assumed'].items())]
    if budget is not None and budget[0] is not None:
      extra = est['runtime'] + (0 if another_device else est['heap_holes'])
      need = r['peak'] + extra
      fits = need <= budget[0]
      lines.append(f'  memory: {"fits" if fits else "does not fit"} {budget[1]}: {memory.human_bytes(need)} of '
                   f'{memory.human_bytes(budget[0])} (traced tensors + {memory.human_bytes(extra)} runtime'
                   f'{"" if another_device else " and heap holes"} from the estimate)')
      if not fits:
        over.append(f'{r["where"]} needs {memory.human_bytes(need)}')
  refusal = (f'the traced step does not fit {budget[1]} ({memory.human_bytes(budget[0])}): ' + '; '.join(over)
             if over else None)
  return '\n'.join(lines), refusal


def print_progress(line):
  print(line, file=sys.stderr, flush=True)
