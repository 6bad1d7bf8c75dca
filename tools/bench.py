"""Time training steps: tokens/s, achieved FLOP/s and MFU against the device's peak.

    python -m tools.bench --config=configs/llama_tiny.py
    python -m tools.bench --config=configs/llama_50m.py --steps=5 --warmup=2

Chunked cross-entropy before and after: tools/bench_ce.py.

Warm-up steps are excluded; the figure is the median of the timed steps. The peak is the
datasheet bf16 dense figure on CUDA and a measured 2048^3 matmul elsewhere (printed), per
process; MFU divides by peak x world size. Under torchrun every rank prints its view:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m tools.bench \
        --config=configs/llama_tiny.py --config.distributed_strategy.tensor_model_parallel_size=2

With model.compile the first step includes compiling the blocks: it prints apart, with the
compile seconds, from the steady-state figures. --compare_compile times eager and compiled
steps interleaved (eager, compiled, eager, ...) per precision recipe and prints a table
(--bench_hf_model: tools/bench_hf.py's 32M Llama instead of --config's model):

    python -m tools.bench --config=configs/llama_tiny.py --compare_compile=fp32,mixed_precision,bf16SR,autocast

--compare_moe (a config with model.moe): its MoE model, the dense model of equal active FLOPs
(ffn = top_k x the expert width, no router) and transformers' Mixtral (its eager experts loop,
dropless, from the same initial weights), stepped interleaved on the same batches (fp32):

    python -m tools.bench --config=configs/mixtral_tiny.py --compare_moe
"""
import dataclasses
import os
import resource
import statistics
import time

from absl import app, flags
from ml_collections import config_flags
import torch

import tools
from configs import validate
from data.loader import Loader
from estimates import memory, memory_check
from model import flop_count, hf, moe, param_table
from optim import update
from parallel import compiled, device as devices, mesh as meshes, tensor, training

FLAGS = flags.FLAGS


@dataclasses.dataclass
class Run:
  """One model's training state, stepped one timed step at a time."""
  config: object
  mesh: object
  ops: object
  params: dict
  updater: object
  batches: list
  times: list = dataclasses.field(default_factory=list)

  @classmethod
  def build(cls, config, count):
    validate.validate(config, int(os.environ.get('WORLD_SIZE', '1')))
    malloc = devices.configure_host_malloc(config)        # as train.py does
    mesh = meshes.init(config)
    before = memory_check.measured_peak_bytes(mesh.device)
    if malloc:
      memory_check.heap_trim(config, mesh, memory.estimate(config, training.local_sizes(config, mesh), mesh.dp,
                                                           mesh.pp_rank), before)
    params = training.init_params(config, mesh)
    loader = Loader(config, 'train', mesh.dp_rank, mesh.dp)
    return cls(config, mesh, tensor.config_ops(config, mesh), params, update.Updater(params, config, mesh),
               [loader.global_batch(i * config.data.global_batch_size) for i in range(count)])

  def step(self):
    step = len(self.times)
    devices.synchronize(self.mesh.device)
    start = time.perf_counter()
    training.train_step(self.params, self.updater, self.batches[step], self.config, step, self.mesh, self.ops,
                        defer_param_gather=True)       # as train.py: ZeRO-1's gathers overlap the next forward
    devices.synchronize(self.mesh.device)
    self.times.append(time.perf_counter() - start)


def bench(config, steps, warmup):
  """Median step time and derived figures as a dict."""
  baseline_rss = max_rss()
  run = Run.build(config, steps + warmup)
  before = compiled.stats()
  for _ in range(steps + warmup):
    run.step()
  mesh, device = run.mesh, run.mesh.device
  step_time = statistics.median(run.times[warmup:])
  tokens = config.data.global_batch_size * config.data.seq_length
  flops = flop_count.flops_per_token(config.model, config.data.seq_length) * tokens / step_time
  peak, source = devices.peak_flops(device) if device.type == 'cuda' else (
      devices.measured_matmul_flops(device, n=2048), f'measured fp32 2048^3 matmul on {device.type}')
  after = compiled.stats()
  return {'name': config.name, 'params': param_table.count_params(config.model), 'mesh': mesh.describe(),
          'device': str(device), 'tokens_per_step': tokens, 'step_time': step_time,
          'tokens_per_sec': tokens / step_time, 'flops': flops, 'peak': peak, 'peak_source': source,
          'mfu': flops / (peak * mesh.world_size), 'threads': torch.get_num_threads(),
          'peak_rss': max_rss(), 'baseline_rss': baseline_rss, 'pid': os.getpid(),
          'first_step': run.times[0], 'compile_s': after['compile_s'] - before['compile_s'],
          'graphs': after['graphs'] - before['graphs']}


def compare_compile(base_config, recipes, steps, warmup):
  """Per recipe: eager and compiled steps interleaved; tok/s of each (medians past warm-up),
  the speed-up, the compiled run's first step and compile seconds, and its graph count."""
  rows = []
  for recipe in recipes:
    runs = []
    for on in (False, True):
      c = base_config.copy_and_resolve_references()
      c.precision.type, c.model.compile = recipe, on
      runs.append(Run.build(c, steps + warmup))
    before = compiled.stats()
    for _ in range(steps + warmup):
      for run in runs:
        run.step()
    after = compiled.stats()
    tokens = base_config.data.global_batch_size * base_config.data.seq_length
    eager, comp = (tokens / statistics.median(run.times[warmup:]) for run in runs)
    rows.append({'recipe': recipe, 'eager': eager, 'compiled': comp, 'speedup': comp / eager,
                 'first_step': runs[1].times[0], 'eager_first_step': runs[0].times[0],
                 'compile_s': after['compile_s'] - before['compile_s'], 'graphs': after['graphs'] - before['graphs']})
  return rows


def compare_moe(config, steps, warmup):
  """{name: tokens/s}: the MoE model, its dense equal-active-FLOPs twin and transformers' Mixtral,
  one step each in turn on the same batches (medians past warm-up)."""
  from tools import bench_hf  # pylint: disable=import-outside-toplevel
  m = config.model
  dense = config.copy_and_resolve_references()
  dense.model.moe.num_experts = 0
  dense.model.ffn_hidden_size = moe.expert_ffn_size(m) * m.moe.top_k
  runs = {'flatron MoE': Run.build(config, steps + warmup), 'flatron dense (equal active FLOPs)': Run.build(dense, steps + warmup)}
  model, optimizer = _hf_mixtral(config, runs['flatron MoE'].params)
  hf_times = []
  for step in range(steps + warmup):
    for run in runs.values():
      run.step()
    start = time.perf_counter()
    bench_hf.hf_step(model, optimizer, runs['flatron MoE'].batches[step], 'fp32', config.trainer.gradient_clip_val,
                     m.optim.lr)
    hf_times.append(time.perf_counter() - start)
  tokens = config.data.global_batch_size * config.data.seq_length
  out = {name: tokens / statistics.median(run.times[warmup:]) for name, run in runs.items()}
  out["transformers' MixtralForCausalLM (dropless)"] = tokens / statistics.median(hf_times[warmup:])
  return out


def _hf_mixtral(config, params):
  os.environ.setdefault('HF_HUB_OFFLINE', '1')
  import transformers  # pylint: disable=import-outside-toplevel
  from optim import optimizers  # pylint: disable=import-outside-toplevel
  m = config.model.copy_and_resolve_references()
  m.moe.dropless = True                        # HF routes every token
  hf_config = transformers.MixtralConfig(**{k: v for k, v in hf.config_to_hf(m).items()
                                            if k not in ('architectures', 'model_type')})
  hf_config._attn_implementation = 'sdpa'  # pylint: disable=protected-access
  model = transformers.MixtralForCausalLM(hf_config)
  def ours(name):       # transformers 5 holds each expert's gate and up as one gate_up_proj
    if name.endswith('.gate_up_proj'):
      base = name.removesuffix('gate_up_proj')
      return torch.cat([params[base + 'gate_proj'], params[base + 'up_proj']], dim=1)
    return params[name]

  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(ours(name.removeprefix('model.')).detach().float()[:p.shape[0]])
  o = config.model.optim
  named = list(model.named_parameters())
  groups = [{'params': [p for n, p in named if optimizers.decays_weight(n)], 'weight_decay': o.weight_decay},
            {'params': [p for n, p in named if not optimizers.decays_weight(n)], 'weight_decay': 0.0}]
  return model.train(), torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def format_table(rows) -> str:
  lines = ['| recipe | eager tok/s | compiled tok/s | speed-up | compile s | first step eager / compiled s | graphs |',
           '|---|---:|---:|---:|---:|---:|---:|']
  for r in rows:
    lines.append(f"| {r['recipe']} | {r['eager']:,.0f} | {r['compiled']:,.0f} | {r['speedup']:.2f}x | "
                 f"{r['compile_s']:.1f} | {r['eager_first_step']:.2f} / {r['first_step']:.2f} | {r['graphs']} |")
  return '\n'.join(lines)


def max_rss():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # Linux reports KiB


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).')
  flags.mark_flag_as_required('config')
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 3, 'Untimed warm-up steps.')
  flags.DEFINE_list('compare_compile', [], 'Precision recipes to time eager against model.compile (a table).')
  flags.DEFINE_bool('bench_hf_model', False, "With --compare_compile: tools/bench_hf.py's 32M Llama.")
  flags.DEFINE_bool('compare_moe', False, "MoE tokens/s beside the dense model of equal active FLOPs and "
                    "transformers' Mixtral (a config with model.moe).")


def main(argv):
  tools.no_arguments(argv)
  if FLAGS.compare_compile:
    config = FLAGS.config
    if FLAGS.bench_hf_model:
      from tools import bench_hf  # pylint: disable=import-outside-toplevel
      config = bench_hf.bench_config('fp32')
    print(f'{config.name}: {param_table.count_params(config.model):,} params, {torch.get_num_threads()} threads, '
          f'median of {FLAGS.steps} steps after {FLAGS.warmup} warm-up, eager and compiled interleaved')
    print(format_table(compare_compile(config, FLAGS.compare_compile, FLAGS.steps, FLAGS.warmup)))
    return
  if FLAGS.compare_moe:
    c = FLAGS.config
    print(f'{c.name}: {c.model.moe.num_experts} experts, top-{c.model.moe.top_k}, '
          f'{param_table.count_params(c.model):,} params, {torch.get_num_threads()} threads, '
          f'{c.data.global_batch_size * c.data.seq_length:,} tokens/step, median of {FLAGS.steps} steps after '
          f'{FLAGS.warmup} warm-up, interleaved')
    for name, rate in compare_moe(c, FLAGS.steps, FLAGS.warmup).items():
      print(f'  MoE tokens/s | {name}: {rate:,.0f}')
    return
  r = bench(FLAGS.config, FLAGS.steps, FLAGS.warmup)
  print(f"{r['name']}: {r['params']:,} params on {r['device']} ({r['threads']} threads), "
        f"{r['tokens_per_step']:,} tokens/step")
  if r['graphs']:
    print(f"  model.compile: first step {r['first_step']:.2f} s, {r['compile_s']:.2f} s of it compiling "
          f"{r['graphs']} graph(s) (forward and backward); warm-up, not in the figures below")
  print(f"  step time (median of {FLAGS.steps}) {r['step_time'] * 1e3:.1f} ms | "
        f"{r['tokens_per_sec']:,.0f} tokens/s | {r['flops'] / 1e9:.1f} GFLOP/s achieved")
  print(f"  peak {r['peak'] / 1e9:.1f} GFLOP/s per process ({r['peak_source']}) | "
        f"MFU {100 * r['mfu']:.1f}% | {r['mesh']} | peak RSS {r['peak_rss'] / 2**20:.0f} MiB "
        f"(+{(r['peak_rss'] - r['baseline_rss']) / 2**20:.0f} MiB over the process before the run)")


if __name__ == '__main__':
  define_flags()
  app.run(main)
