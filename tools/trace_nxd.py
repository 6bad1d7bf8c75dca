"""Trace NxD Training 2.26's example files at their own layout and cluster (--dry_run=trace's
check on each) and print the traced-against-estimated table of docs/dry-run-trace.md.

    python -m tools.trace_nxd                         # all 22 files (~25 minutes on 2 cores)
    python -m tools.trace_nxd hf_llama3_8B_config.yaml
    python -m tools.trace_nxd --best                  # at the planner's best layout for each

Each file with its model's config.json (the fixtures tests/test_nxd_yaml.py uses), judged on
the device of its own cluster (trn2 files: trn2.48xlarge; the others trn1.32xlarge).
"""
import os

import yaml
from absl import app, flags

from configs import from_files, nxd_yaml
from estimates import clusters, memory
import step_trace as trace
from tools import plan as planner

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tests', 'fixtures', 'nxd_yaml')
RELEASE = os.path.join(FIXTURES, '2.26')
# file prefix -> the config.json of its model (HF files); Megatron files name their tokenizer's vocabulary
MODEL_CARDS = {'hf_llama3.1_405B': 'llama3.1_405b', 'hf_llama3.1_70B': 'llama3.1_70b', 'hf_llama3.1_8B': 'llama3.1_8b',
               'hf_llama3_70B': 'llama3_70b', 'hf_llama3_8B': 'llama3_8b', 'hf_llama_7B': 'llama2_7b',
               'hf_mixtral_8x7b': 'mixtral_8x7b'}


def load(name, kv_replicator=None):
  """(config, world size) of release file `name` at its own layout, on its own cluster."""
  path = os.path.join(RELEASE, name)
  config = nxd_yaml.load(path).config
  with open(path, encoding='utf-8') as f:
    trainer = yaml.safe_load(f)['trainer']
  world_size = trainer['devices'] * trainer['num_nodes']
  config.trainer.plan_cluster = 'trn2.48xlarge' if '_trn2' in name else 'trn1.32xlarge'
  config.data.tokenizer.type = 'none'
  card = next((v for k, v in MODEL_CARDS.items() if name.startswith(k + '_')), None)
  if card:
    config.model.model_config = os.path.join(FIXTURES, f'{card}_config.json')
  else:
    config.model.vocab_size = 50257 if 'gpt' in name else 32000
  if kv_replicator:
    config.distributed_strategy.kv_replicator = kv_replicator
  from_files.resolve(config, world_size)
  return config, world_size


def kv_replicator(name):
  """NxD's HF Mixtral files leave kv_replicator unset with 8 KV heads at tp 32: 4, as validation asks."""
  return 4 if name.startswith('hf_mixtral') else None


def row(name, best=False) -> list:
  """The table's rows of one file: one per traced rank; `best`: at the planner's best layout for
  the file's model, batch and cluster instead of the file's own."""
  config, world_size = load(name, kv_replicator(name))
  cluster = clusters.get(config.trainer.plan_cluster)
  if best:
    plan = planner.search(config, cluster, world_size, keep=1)
    if not plan.ranked:
      return [f'| {name} | {world_size:,} | no layout fits | | | | | | |']
    config, layout = plan.ranked[0].config, plan.ranked[0].layout.describe()
  else:
    d = config.distributed_strategy
    layout = (f'tp{d.tensor_model_parallel_size} pp{d.pipeline_model_parallel_size}'
              + (f' cp{d.context_parallel_size}' if d.context_parallel_size > 1 else '')
              + (f' ep{d.expert_model_parallel_size}' if d.get('expert_model_parallel_size', 1) > 1 else ''))
  rows = []
  for r in trace.trace(config, world_size):
    est = trace.tensor_estimate(r['estimate'])
    need = r['peak'] + r['estimate']['runtime']
    fits = 'fits' if need <= cluster.memory_bytes else 'does not fit'
    stage = r['where'].split(' pp ')[1].split(' ')[0]
    rows.append(f'| {name} | {world_size:,} | {layout} | {stage} | {memory.human_bytes(r["peak"])} | '
                f'{memory.human_bytes(est["total"])} | {100 * trace.off_by(r["peak"], est["total"]):+.1f}% | '
                f'{fits} | {r["seconds"]:.0f} s |')
  return rows


def define_flags():
  """The files to trace are the arguments (all 22 when none)."""
  flags.DEFINE_bool('best', False, "Trace the planner's best layout for each file (its model, batch and cluster) "
                    "instead of the file's own layout.")


def main(argv):
  names = argv[1:]
  print('| file | ranks | layout | stage | traced | estimated | traced vs estimate | verdict | time |')
  print('|---|---|---|---|---|---|---|---|---|')
  for name in names or sorted(os.listdir(RELEASE)):
    try:
      lines = row(name, flags.FLAGS.best)
    except Exception as e:  # pylint: disable=broad-except
      lines = [f'| {name} | failed: {e} | | | | | | | |']
    print('\n'.join(lines), flush=True)


if __name__ == '__main__':
  define_flags()
  app.run(main)
