"""Plan a run before paying for it: every valid layout of a config on a cluster, ranked by the
predicted tokens/s (estimates/step_time.py), with memory per device (estimates/memory.py), and
why the rest do not fit (docs/planning.md).

    python -m tools.plan --config=configs/llama3_8b.py --cluster=h100 --nodes=2
    python -m tools.plan --config=configs/nxd_yaml.py:their.yaml --config.model.model_config=config.json \
        --cluster=trn1.32xlarge --nodes=32
    python -m tools.plan --config=configs/llama_tiny.py --cluster=local --devices=2
    python -m tools.plan --calibrate          # measure this machine: the `local` entry

Searched: dp x cp x tp x pp (dp = devices / (tp pp cp)), expert parallel degree (MoE configs),
virtual stages, ZeRO stage (none, 1, 2, 3, and 3 sharded within a node: HSDP), sequence parallel,
micro batch, recompute mode. Each layout is first checked by configs/validate.py (refusals are
counted by message), then by the memory estimate against the device's memory.
"""
import collections
import copy
import dataclasses
import re

from absl import app, flags
from ml_collections import config_flags

from configs import from_files, validate
from estimates import clusters, memory, step_time, summary
from model import flop_count, param_table
from parallel import mesh as meshes, training
import step_trace as traces
import tools
from tools.plan_space import RECOMPUTE, Layout, layouts
import user_errors

MEMORY = "memory: the estimate exceeds the device's memory"


@dataclasses.dataclass
class Candidate:
  layout: Layout
  config: object
  prediction: step_time.Prediction
  memory_bytes: float


@dataclasses.dataclass
class Plan:
  ranked: list               # the `keep` fastest Candidates that fit, fastest first
  refused: collections.Counter   # reason -> layouts
  searched: int
  fitting: int               # layouts that are valid and fit (ranked keeps the best of them)


def _reason(message):
  """A refusal message with its numbers taken out, so alike refusals count together."""
  return re.sub(r'\d+(\.\d+)?', 'N', message.split(';')[0])[:140]


def search(config, cluster, world_size, keep=10, fp8=None) -> Plan:
  """Rank every valid layout of `config` on `world_size` devices of `cluster` that fits (`fp8`: a
  recipe to plan beside the config's own precision.fp8)."""
  work = copy.deepcopy(config)
  work.device = cluster.device
  refused, found, searched, fitting = collections.Counter(), [], 0, 0
  counts = (param_table.count_params(work.model), param_table.count_params(work.model, trainable_only=True),
            flop_count.flops_per_token(work.model, work.data.seq_length))
  stages = {}                # (tp, pp, vpp, cp, ep) -> stage_sizes (walking 80 layers' names costs ms)
  too_big = {}               # (tp, pp, vpp, zero, sp, ...) -> [(micro batch, recompute)] that did not fit
  for layout in layouts(config, world_size, fp8, cluster.devices_per_node):
    searched += 1
    if layout.tp > cluster.devices_per_node:    # TP's per-layer collectives over the network: never a win
      refused['tp > devices per node: TP stays inside a node'] += 1
      continue
    layout.apply(work)
    problems = validate.check(work, world_size)
    if problems:
      refused[_reason(problems[0])] += 1
      continue
    # Memory only grows with the micro batch (in flight: min(pp x mb, batch per replica)) and
    # as recompute keeps more: a layout above one that did not fit does not fit either.
    family = (layout.tp, layout.pp, layout.vpp, layout.zero1, layout.zero_stage, layout.shard, layout.sp, layout.cp,
              layout.ep, layout.fp8)
    more = list(RECOMPUTE).index
    if any(layout.micro_batch >= mb and more(layout.recompute) <= more(r) for mb, r in too_big.get(family, ())):
      refused[MEMORY] += 1
      continue
    shape = (layout.tp, layout.pp, layout.vpp, layout.cp, layout.ep)
    if shape not in stages:
      stages[shape] = stage_sizes(work, world_size)
    need = max(memory.estimate(work, sizes, layout.dp, pp_rank)['total'] for pp_rank, sizes in stages[shape])
    if need > cluster.memory_bytes:
      refused[MEMORY] += 1
      too_big.setdefault(family, []).append((layout.micro_batch, layout.recompute))
      continue
    fitting += 1
    bound = found[keep - 1][0].step_s if len(found) >= keep else None
    p = step_time.predict(work, cluster, world_size, counts=counts, slower_than=bound)
    if p is not None:      # None: slower than the keep-th best already found
      found.append((p, layout, need))
      found.sort(key=lambda item: (item[0].step_s, item[2]))
      del found[keep:]
  ranked = [Candidate(layout, layout.apply(copy.deepcopy(work)), p, need) for p, layout, need in found]
  return Plan(ranked, refused, searched, fitting)


def stage_sizes(config, world_size) -> list:
  """[(pp_rank, name -> elements its rank holds)] of the first and the last pipeline stage: the
  first holds the embedding and the most micro batches in flight, the last the head; an even
  share of the model misses both (the traces of NxD's 70B trn2 file found a planned layout
  whose first stage did not fit)."""
  mesh = meshes.layout(config, world_size)
  return [(p, training.local_sizes(config, meshes.layout(config, world_size, mesh.rank_of(pp_rank=p))))
          for p in sorted({0, mesh.pp - 1})]


def report(config, cluster, world_size, plan, top=10) -> str:
  lines = [f'{config.name} on {summary.on_cluster(cluster, world_size)} ({cluster.source}); '
           f'{plan.searched} layouts searched, {plan.fitting} valid and fitting',
           '| layout | tokens/s | MFU | step s | memory/device | bubble | communication |', '|---|---|---|---|---|---|---|']
  for c in plan.ranked[:top]:
    p = c.prediction
    lines.append(f'| {c.layout.describe()} | {p.tokens_per_s:,.0f} | {p.mfu:.1%} | {p.step_s:.3g} | '
                 f'{memory.human_bytes(c.memory_bytes)} | {p.bubble:.1%} | {p.comm:.1%} |')
  if not plan.ranked:
    lines.append('| no layout fits | | | | | | |')
  lines.append(f'refused ({sum(plan.refused.values())} layouts), by reason:')
  lines += [f'  {n:6d}  {reason}' for reason, n in plan.refused.most_common()]
  return '\n'.join(lines)


def trace_top(plan, cluster, world_size, n, progress=None) -> tuple:
  """(text, layouts that do not fit): the best `n` layouts of `plan` traced (step_trace.py:
  the first and last stage's real step on fake tensors), each peak against the cluster's device."""
  lines, over = [], []
  for c in plan.ranked[:n]:
    text, refusal = traces.report(traces.trace(c.config, world_size, progress=progress),
                                  (cluster.memory_bytes, f'a {cluster.name} device'), another_device=True)
    lines += [f'traced {c.layout.describe()} (estimated {memory.human_bytes(c.memory_bytes)}):', text]
    if refusal:
      over.append(f'{c.layout.describe()}: {refusal}')
  return '\n'.join(lines), over


def world(cluster, nodes, devices) -> int:
  """Devices of the run: --devices, else --nodes x the cluster's devices per node."""
  if devices:
    return devices
  if not nodes or nodes < 1:
    raise ValueError('give --nodes=N (whole nodes of the cluster) or --devices=N')
  return nodes * cluster.devices_per_node


def resolve(config):
  """What a run fills in from the user's files (config.json) before planning."""
  if config.model_source == 'hf':
    try:
      from_files.apply_hf_model_config(config)
    except validate.ConfigError as e:
      raise validate.ConfigError(f'{e}; the planner needs the architecture: give the model\'s config.json with '
                                 '--config.model.model_config=PATH') from None


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]) or '
                                  'configs/nxd_yaml.py:their.yaml; --config.key=value overrides.')
  flags.DEFINE_string('cluster', 'local', f'Cluster name (of {", ".join(clusters.names())}).')
  flags.DEFINE_integer('nodes', 0, 'Nodes of the cluster.')
  flags.DEFINE_integer('devices', 0, 'Devices (ranks) in all, instead of --nodes.')
  flags.DEFINE_integer('top', 10, 'Layouts to print.')
  flags.DEFINE_enum('fp8', None, ['tensorwise', 'rowwise'], 'Also plan the layouts with this precision.fp8 '
                    'recipe (a config with FP8 on is planned without it too).')
  flags.DEFINE_integer('trace', 0, 'Trace the best N layouts: one rank per differing program runs the real '
                       'training step on fake tensors (--dry_run=trace), its peak set against the device.')
  flags.DEFINE_bool('calibrate', False, 'Measure this machine and write the `local` entry, then exit.')


def main(argv):
  """Errors a user can fix end in one line, exit 2 (user_errors.py)."""
  user_errors.exit_on_error(_main, argv, also=(ValueError,))


def _main(argv):
  tools.no_arguments(argv)
  FLAGS = flags.FLAGS   # pylint: disable=invalid-name
  if FLAGS.calibrate:
    from tools import plan_calibrate   # pylint: disable=import-outside-toplevel
    plan_calibrate.main()
    return
  if FLAGS.config is None:
    tools.fail('--config is required (a configs/*.py file, or configs/nxd_yaml.py:their.yaml)')
  cluster = clusters.get(FLAGS.cluster)
  world_size = world(cluster, FLAGS.nodes, FLAGS.devices)
  config = FLAGS.config
  resolve(config)
  plan = search(config, cluster, world_size, keep=FLAGS.top, fp8=FLAGS.fp8)
  print(report(config, cluster, world_size, plan, FLAGS.top))
  if FLAGS.trace and plan.ranked:
    text, over = trace_top(plan, cluster, world_size, FLAGS.trace, traces.print_progress)
    print(text)
    if over:
      tools.fail('traced peaks past the device: ' + '; '.join(over))
  if not plan.ranked:
    tools.fail(f'no layout of {world_size} {cluster.name} devices fits {config.name}: use more devices, '
               'a smaller data.global_batch_size or a smaller model (reasons above)')


if __name__ == '__main__':
  define_flags()
  app.run(main)
