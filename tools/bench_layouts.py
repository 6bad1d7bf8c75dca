"""Multi-rank efficiency: each 2-process layout against 1 process at equal total threads.

    python -m tools.bench_layouts                      # dp2, tp2, pp2 (1F1B) and pp2 with deallocated outputs
    python -m tools.bench_layouts --layouts=dp2,pp2 --steps=3
    python -m tools.bench_layouts --layouts=dp2,dp2_no_overlap   # overlap_grad_reduce on / off
    python -m tools.bench_layouts --shape=207m --layouts=dp2,dp2_zero1 --steps=3
    python -m tools.bench_layouts --shape=207m --layouts=dp2_zero1,dp2_zero2 --steps=3   # ZeRO-2 against ZeRO-1
    python -m tools.bench_layouts --shape=207m --layouts=dp2_zero1,dp2_zero3,dp4_zero1,dp4_zero3 --steps=3   # ZeRO-3
    python -m tools.bench_layouts --shape=long16k --layouts=cp2 --steps=2 --warmup=1   # context parallelism
    python -m tools.bench_layouts --shape=long16k --layouts=cp2 --steps=2 --warmup=1 --mmap_threshold=65536

Runs train.py itself (`--runner=train`, the default: the loop a user runs, logging every step,
no validation or checkpoints; its steps after `--warmup` timed from metrics.jsonl, and every
rank's peak RSS beside its start-up estimate from the run's last line) or tools/bench.py's copy
of the step (`--runner=bench`), once in one process with 2 threads, then under torchrun with 2
processes x 1 thread per layout (4 for the dp4_ layouts: two to a core), and prints tokens/s, the efficiency (layout / one process),
peak RSS per rank, and for pipelines the measured bubble (1 - efficiency) beside the 1F1B
formula (p - 1) / (m + p - 1) for p stages and m micro batches. Every process is killed
(its process group) if the run fails or times out.
"""
import json
import tempfile
import os
import re
import signal
import subprocess
import sys

from absl import app, flags

import tools

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY = '--config.distributed_strategy.'
LAYOUTS = {
    'dp2': [],
    'dp2_no_overlap': [STRATEGY + 'overlap_grad_reduce=False'],
    'dp2_zero1': [STRATEGY + 'zero1=True'],
    'dp2_zero1_no_overlap': [STRATEGY + 'zero1=True', STRATEGY + 'overlap_grad_reduce=False'],
    'dp2_zero1_no_param_overlap': [STRATEGY + 'zero1=True', STRATEGY + 'overlap_param_gather=False'],
    'dp2_zero1_all_reduce': [STRATEGY + 'zero1=True', STRATEGY + 'zero1_collectives=all_reduce'],
    'dp2_zero2': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=2'],
    'dp2_zero3': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3'],
    'dp2_zero3_kept': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3', STRATEGY + 'reshard_after_forward=False'],
    'dp2_zero3_whole_grads': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3',
                              STRATEGY + 'grad_reduce_per_micro_batch=False'],
    'dp2_zero3_once': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3', STRATEGY + 'grad_reduce_per_micro_batch=False',
                       STRATEGY + 'reshard_after_backward=False'],     # one gather and one reduction a step
    'dp4_zero1': [STRATEGY + 'zero1=True'],                 # dp4_*: 4 processes
    'dp4_zero2': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=2'],
    'dp4_zero3': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3'],
    'dp4_zero3_whole_grads': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3',
                              STRATEGY + 'grad_reduce_per_micro_batch=False'],
    'dp4_zero3_once': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3', STRATEGY + 'grad_reduce_per_micro_batch=False',
                       STRATEGY + 'reshard_after_backward=False'],
    'dp4_hsdp2_zero3': [STRATEGY + 'zero1=True', STRATEGY + 'zero_stage=3', STRATEGY + 'data_parallel_shard_size=2'],
    'tp2': [STRATEGY + 'tensor_model_parallel_size=2'],
    'tp2_sp': [STRATEGY + 'tensor_model_parallel_size=2', STRATEGY + 'sequence_parallel=True'],
    'pp2': [STRATEGY + 'pipeline_model_parallel_size=2'],
    'pp2_dealloc': [STRATEGY + 'pipeline_model_parallel_size=2', STRATEGY + 'deallocate_pipeline_outputs=True'],
    'cp2': [STRATEGY + 'context_parallel_size=2', '--config.model.fusions.ring_attention=True'],
    'ep2': [STRATEGY + 'expert_model_parallel_size=2'],      # a MoE config (configs/mixtral_tiny.py)
}
# A model big enough that per-step compute dominates process start-up noise, small enough for 2 cores.
SMALL = ['--config.model.num_layers=4', '--config.model.hidden_size=256', '--config.model.ffn_hidden_size=688',
         '--config.model.num_attention_heads=8', '--config.model.num_kv_heads=4', '--config.model.vocab_size=4096',
         '--config.model.max_position_embeddings=256', '--config.data.seq_length=256',
         '--config.data.micro_batch_size=2', '--config.data.global_batch_size=16']
# The 207M shape (12 x 1024): where ZeRO-1's memory and speed are judged.
SHAPE_207M = ['--config.model.num_layers=12', '--config.model.hidden_size=1024', '--config.model.ffn_hidden_size=2816',
              '--config.model.num_attention_heads=16', '--config.model.num_kv_heads=8', '--config.model.vocab_size=32000',
              '--config.model.max_position_embeddings=128', '--config.data.seq_length=128',
              '--config.data.micro_batch_size=1', '--config.data.global_batch_size=4']
# Long context on a tiny model: one sequence of 16k tokens, where activations dominate.
LONG_16K = ['--config.model.num_layers=2', '--config.model.hidden_size=128', '--config.model.ffn_hidden_size=344',
            '--config.model.num_attention_heads=4', '--config.model.num_kv_heads=2', '--config.model.vocab_size=512',
            '--config.model.max_position_embeddings=16384', '--config.data.seq_length=16384',
            '--config.data.micro_batch_size=1', '--config.data.global_batch_size=2']
# configs/llama_50m.py's model and batch (8 x 512, seq 512, 8 sequences a step).
SHAPE_50M = ['--config.model.num_layers=8', '--config.model.hidden_size=512', '--config.model.ffn_hidden_size=1408',
             '--config.model.num_attention_heads=8', '--config.model.num_kv_heads=4', '--config.model.vocab_size=32000',
             '--config.model.max_position_embeddings=1024', '--config.data.seq_length=512',
             '--config.data.micro_batch_size=2', '--config.data.global_batch_size=8']
SHAPES = {'small': (SMALL, 16 // 2), '207m': (SHAPE_207M, 4), 'llama_50m': (SHAPE_50M, 4), 'long16k': (LONG_16K, 2)}   # (flags, the pipeline's m at pp2)


def processes(layout) -> int:
  """The ranks `layout` runs on: 4 for the dp4_ layouts, else 2."""
  return 4 if layout.startswith('dp4') else 2


def _run(cmd, env, timeout):
  out = _output(cmd, env, timeout)
  tok = [float(x.replace(',', '')) for x in re.findall(r'\| ([\d,]+) tokens/s', out)]
  rss = [float(x) for x in re.findall(r'peak RSS (\d+) MiB', out)]
  growth = [float(x) for x in re.findall(r'\(\+(\d+) MiB over the process before the run\)', out)]
  return min(tok), max(rss), max(growth)


def _run_train(cmd, env, timeout, steps):
  """(tokens/s of the timed steps, largest peak RSS of a rank, its growth over the process before
  the run, the largest estimate error) of a train.py run whose command ends before --workdir."""
  with tempfile.TemporaryDirectory() as workdir:
    out = _output(cmd + [f'--workdir={workdir}'], env, timeout)
    with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
      records = [r for r in map(json.loads, f) if r.get('loss') is not None]
  timed = records[-steps:]
  tokens = timed[0]['tokens_per_sec'] * timed[0]['step_time']          # tokens per step
  ranks = re.findall(r'rank \d+: ([\d,]+) MiB \(([+-][\d.]+)% of [\d,]+ MiB; ([\d,]+) MiB in all\)', out)
  grown, error, whole = zip(*[(float(g.replace(',', '')), float(e), float(a.replace(',', ''))) for g, e, a in ranks])
  return tokens * len(timed) / sum(r['step_time'] for r in timed), max(whole), max(grown), max(error, key=abs)


def _output(cmd, env, timeout):
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  if proc.returncode:
    raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}')
  return out


def define_flags():
  flags.DEFINE_string('config', 'configs/llama_tiny.py', 'Config file for tools/bench.py (--shape resizes it).')
  flags.DEFINE_enum('shape', 'small', list(SHAPES), 'small: 4 x 256, seq 256, 16 sequences a step; 207m: 12 x 1024; '
                    'llama_50m: 8 x 512, seq 512; long16k: 2 x 128 at seq 16384, 2 sequences a step.')
  tools.define_list_of('layouts', ['dp2', 'tp2', 'tp2_sp', 'pp2', 'pp2_dealloc'], LAYOUTS, 'Layouts to run')
  flags.DEFINE_integer('steps', 5, 'Timed steps.')
  flags.DEFINE_integer('warmup', 2, 'Untimed warm-up steps.')
  flags.DEFINE_multi_string('set', [], 'A config override for every run, e.g. --set=precision.type=bf16SR.')
  flags.DEFINE_enum('runner', 'train', ['train', 'bench'], 'train: time train.py itself (what a user gets); bench: '
                    'tools/bench.py\'s copy of the step.')
  flags.DEFINE_integer('timeout', 900, 'Seconds each bench may take before its processes are killed.')
  flags.DEFINE_integer('mmap_threshold', 0, 'glibc MALLOC_MMAP_THRESHOLD_ (bytes) for every process; 0 = glibc\'s '
                       'dynamic one, which rises after big frees so that later temporaries stay in the heap: peak '
                       'RSS then holds fragmentation too, not only live tensors.')


def main(argv):
  tools.no_arguments(argv)
  tools.exit_on_sigterm()
  shape, micro = SHAPES[FLAGS.shape]
  shape = shape + [f'--config.{item}' for item in FLAGS.set]
  env = dict(os.environ, **({'MALLOC_MMAP_THRESHOLD_': str(FLAGS.mmap_threshold)} if FLAGS.mmap_threshold else {}))
  if FLAGS.mmap_threshold:
    print(f'MALLOC_MMAP_THRESHOLD_={FLAGS.mmap_threshold} in every process')
  if FLAGS.runner == 'train':     # the loop itself, every step logged; its last line: each rank's peak
    program = ['train.py', f'--config={FLAGS.config}', f'--config.trainer.max_steps={FLAGS.warmup + FLAGS.steps}',
               '--config.trainer.log_every_n_steps=1', '--config.trainer.val_check_interval=0',
               '--config.exp_manager.create_tensorboard_logger=False', '--config.model.optim.sched.warmup_steps=0'] + shape
    run = lambda cmd, threads: _run_train(cmd, dict(env, OMP_NUM_THREADS=threads), FLAGS.timeout, FLAGS.steps)
  else:
    program = ['-m', 'tools.bench', f'--config={FLAGS.config}', f'--steps={FLAGS.steps}',
               f'--warmup={FLAGS.warmup}'] + shape
    run = lambda cmd, threads: _run(cmd, dict(env, OMP_NUM_THREADS=threads), FLAGS.timeout) + (None,)
  one, one_rss, one_growth, one_error = run([sys.executable] + program, '2')
  print(f'{FLAGS.runner}, 1 process x 2 threads: {one:,.0f} tokens/s, peak RSS {one_rss:.0f} MiB (+{one_growth:.0f} '
        'MiB over the process before the run: the run\'s own memory, activations included'
        + (f'; {one_error:+.1f}% of the estimate)' if one_error is not None else ')'))
  print('| layout (processes x 1 thread) | tokens/s | efficiency | peak RSS / rank | its run\'s own | vs estimate '
        '| bubble measured | 1F1B formula |')
  print('|---|---|---|---|---|---|---|---|')
  for name in FLAGS.layouts:
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={processes(name)}'] + program
    tok, rss, growth, error = run(cmd + LAYOUTS[name], '1')
    bubble = f'{1 - tok / one:.1%} | {(2 - 1) / (micro + 2 - 1):.1%}' if name.startswith('pp2') else ' | '
    versus = f'{error:+.1f}%' if error is not None else ''
    print(f'| {name} | {tok:,.0f} | {tok / one:.0%} | {rss:.0f} MiB | +{growth:.0f} MiB | {versus} | {bubble} |',
          flush=True)

if __name__ == '__main__':
  define_flags()
  app.run(main)
