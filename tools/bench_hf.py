"""flatron against Hugging Face on the same model, side by side in one process, and the ceiling.

    python -m tools.bench_hf                        # a 32M Llama, fp32 / mixed / bf16 (a 5M one for
                                                    # the 16-bit rows where the CPU has no bf16 GEMMs)
    python -m tools.bench_hf --precisions=fp32 --steps=3
    python -m tools.bench_hf --precisions=bf16 --clock=cpu --profile   # a shared machine; where time goes
    python -m tools.bench_hf --device=cuda --model=tinyllama_1b --compile  # a GPU: 1.1B, both compiled

Both sides train the same Llama (transformers' LlamaForCausalLM with torch.optim.AdamW, and
flatron's loop step), from the same weights, on the same token batches, steps interleaved
(HF, flatron, HF, ...) so drift in the machine's speed hits both alike. Per precision:
  fp32   HF fp32                      vs flatron precision.type=fp32
  mixed  HF fp32 under torch.autocast(bf16) vs flatron mixed_precision (bf16 weights, fp32 masters)
  bf16   HF .to(bfloat16)             vs flatron bf16SR (bf16 weights, stochastic rounding)
It prints tok/s, the ratio, MFU (against a measured matmul peak), the bytes of parameters +
gradients + optimizer state each side holds and the peak memory (both sides together: the
process's RSS, on a GPU its peak allocated), then the ceiling: the step's GEMMs and attention
alone (forward and backward, timed one by one, each the best of 3; once after each timed pair
of steps, the median of those, so a slow spell of a shared machine weighs on both as on the
steps), and the fraction of it each side reaches.
--clock=cpu times steps in this process's CPU seconds (all its threads) instead of wall seconds:
on a machine shared with other jobs, waiting for a core does not count against either side.
--profile prints flatron's step under torch.profiler, the ops by their own CPU time; on a GPU
HF's step too, and for each how long the GPU worked within it and its longest idle gaps.
--nocuda_graph_update launches flatron's fused update call by call on a GPU instead of
replaying it as one CUDA graph (optim/graphed.py): the A/B of that.
--compile compiles both sides per block (flatron's model.compile, each HF decoder layer's
torch.compile); the ceiling stays the eager GEMMs and attention.
--nokeep_freed_host_memory leaves glibc's malloc as it comes (train.py's keep_freed_host_memory
is on by default on the CPU, and so is this, for both sides: one process): both sides then
fault the blocks they freed in again every step. Neither side hands the heap's free pages back
near its memory estimate (train.py's trim_host_heap): HF's step has no such hook.
--device=cuda runs both sides on the GPU (HF's AdamW fused, as flatron's fp32-master recipes
step there; fp32 matmuls in fp32, TF32 off on both); MFU is then against the card's datasheet
bf16 dense peak (parallel/device.py), which the line above the table names beside a measured
bf16 8192^3 matmul. --model picks the shape (MODELS); --seq_length / --micro_batch_size /
--global_batch_size override its batch.
"""
import os
import resource
import statistics
import time

from absl import app, flags
import torch
import torch.nn.functional as F

import tools
from tools import step_profile
from configs import llama_tiny
from data.loader import Loader
from model import flop_count, hf
from optim import graphed, optimizers, update
from parallel import device as devices, mesh as meshes, tensor, training

FLAGS = flags.FLAGS
RECIPES = {'fp32': 'fp32', 'mixed': 'mixed_precision', 'bf16': 'bf16SR'}
CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}


# name -> (layers, hidden, ffn, heads, KV heads, vocab, seq, micro batch, global batch)
MODELS = {
    'bench32m': (8, 512, 1408, 8, 4, 8192, 256, 8, 8),           # a 32M Llama (the CPU benchmark)
    # a 5M Llama, 1/60 of bench32m's arithmetic a step: the 16-bit rows where the CPU has no bf16
    # GEMMs (AVX2 alone: 0.4-0.6 GFLOP/s against fp32's 27; auto picks it)
    'bench5m': (4, 256, 688, 4, 2, 4096, 128, 1, 2),
    'llama_50m': (8, 512, 1408, 8, 4, 32000, 2048, 8, 16),       # configs/llama_50m.py's shape
    'tinyllama_1b': (22, 2048, 5632, 32, 4, 32000, 2048, 4, 16),  # TinyLlama-1.1B's shape
    # next to no arithmetic: each side's host time per step (Python, dispatch, autograd), which
    # is what a GPU's small models wait on
    'host_overhead': (8, 64, 172, 4, 2, 512, 32, 1, 8),
}


def bench_config(precision, model='bench32m', seq_length=0, micro_batch_size=0, global_batch_size=0,
                 device='cpu'):
  """A Llama of MODELS[model] (untied head, no scaled init) for `precision`, batch overridable."""
  c = llama_tiny.get_config()
  m = c.model
  (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_kv_heads, m.vocab_size,
   seq, micro, global_batch) = MODELS[model]
  m.use_scaled_init_method = False
  c.data.seq_length = seq_length or seq
  c.data.micro_batch_size = micro_batch_size or micro
  c.data.global_batch_size = global_batch_size or global_batch
  m.max_position_embeddings = c.data.seq_length
  c.precision.type = RECIPES[precision]
  c.trainer.gradient_clip_val = 1.0
  c.model.optim.sched.warmup_steps = 0
  c.device = device
  return c


def hf_model(config, params, precision):
  os.environ.setdefault('HF_HUB_OFFLINE', '1')     # read when transformers is first imported
  import transformers  # pylint: disable=import-outside-toplevel
  hf_config = transformers.LlamaConfig(**{k: v for k, v in hf.config_to_hf(config.model).items()
                                          if k not in ('architectures', 'model_type')})
  hf_config._attn_implementation = 'sdpa'  # pylint: disable=protected-access
  device = next(iter(params.values())).device
  with device:                 # built where it trains (a 1B model's CPU init takes minutes)
    model = transformers.LlamaForCausalLM(hf_config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      ours = params[name.removeprefix('model.')].detach().float()
      p.copy_(ours[:p.shape[0]])
  if precision == 'bf16':
    model = model.to(torch.bfloat16)
  o = config.model.optim
  # flatron's groups: no weight decay on norms and biases
  named = list(model.named_parameters())
  groups = [{'params': [p for n, p in named if optimizers.decays_weight(n)], 'weight_decay': o.weight_decay},
            {'params': [p for n, p in named if not optimizers.decays_weight(n)], 'weight_decay': 0.0}]
  # on CUDA HF's Trainer steps AdamW fused (its default optim there), as flatron's fp32 steps do
  optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=device.type == 'cuda')
  return model.train(), optimizer


def hf_step(model, optimizer, micro_batches, precision, clip, lr):
  """One HF training step on flatron's micro batches (the same labels, the same lr); returns the loss."""
  for group in optimizer.param_groups:
    group['lr'] = lr
  total, device = 0.0, model.device
  for mb in micro_batches:
    with torch.autocast(device.type, torch.bfloat16, enabled=precision == 'mixed'):
      logits = model(input_ids=mb['tokens'].to(device), use_cache=False).logits   # training: no KV cache
    loss = F.cross_entropy(logits.float().flatten(0, 1), mb['labels'].to(device).flatten()) / len(micro_batches)
    loss.backward()
    total += loss.item()
  torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
  optimizer.step()
  optimizer.zero_grad(set_to_none=True)
  return total


def state_bytes(tensors):
  return sum(t.numel() * t.element_size() for t in tensors)


def run(precision, steps, warmup, config=None, clock='wall', profile=False, compile_blocks=False, ceiling=None):
  """Interleaved steps of both sides: tok/s, state bytes and each side's losses. `compile_blocks`:
  flatron's model.compile and torch.compile of each HF decoder layer (regional on both sides;
  the compiles fall in the warm-up steps). `ceiling`: a function timed after each timed pair of
  steps (the ceiling's (seconds, GEMM s, attention s)); 'ceiling' is the median by seconds, so
  it samples the machine over the same minutes as the steps' medians do."""
  config = config or bench_config(precision)
  if compile_blocks:
    config.model.compile = True
    # another precision's graphs of the same code would count as recompiles (dynamo's limit)
    torch._dynamo.reset()  # pylint: disable=protected-access
  mesh = meshes.init(config)
  ops = tensor.make_ops(mesh)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  model, optimizer = hf_model(config, params, precision)
  if compile_blocks:
    # one graph for every layer where dynamo can; the limit only matters where it cannot
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,  # pylint: disable=protected-access
                                                config.model.num_layers + 8)
    for layer in model.model.layers:
      layer.compile()
  loader = Loader(config, 'train', 0, 1)
  times, losses, ceilings = {'hf': [], 'flatron': []}, {'hf': [], 'flatron': []}, []

  def timed(side, fn):
    devices.synchronize(mesh.device)        # a GPU's queue: each side's time is its own work
    start = CLOCKS[clock]()
    losses[side].append(fn())
    devices.synchronize(mesh.device)
    times[side].append(CLOCKS[clock]() - start)

  for i in range(steps + warmup):
    batch = loader.global_batch(i * config.data.global_batch_size)
    lr = updater.lr(i)
    timed('hf', lambda: hf_step(model, optimizer, batch, precision, config.trainer.gradient_clip_val, lr))
    timed('flatron', lambda: training.train_step(params, updater, batch, config, i, mesh, ops)['loss'].item())
    if ceiling is not None and i >= warmup:
      ceilings.append(ceiling())
  tokens = config.data.global_batch_size * config.data.seq_length
  hf_params = list(model.parameters())
  hf_optim = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
  result = {name: tokens / statistics.median(t[warmup:]) for name, t in times.items()}
  # parameters + gradients (as each accumulates them) + optimizer state and masters
  result['hf_bytes'] = 2 * state_bytes(hf_params) + state_bytes(hf_optim)
  result['flatron_bytes'] = state_bytes(params.values()) + updater.state_bytes() + updater.grads.bytes()
  result['config'], result['losses'] = config, losses
  if ceilings:
    result['ceiling'] = sorted(ceilings)[(len(ceilings) - 1) // 2]     # the faster of two middles
  if profile:
    batch, i, lr = loader.global_batch(0), steps + warmup, updater.lr(steps + warmup)
    result['profile'] = step_profile.profile_step(
        lambda: training.train_step(params, updater, batch, config, i, mesh, ops)['loss'].item(), mesh.device)
    if mesh.device.type == 'cuda':        # HF's too: where each side's GPU waits
      result['hf_profile'] = step_profile.profile_step(
          lambda: hf_step(model, optimizer, batch, precision, config.trainer.gradient_clip_val, lr), mesh.device)
  return result


def auto_models(precisions, device):
  """--model=auto: bench32m for every row, but bench5m for the 16-bit rows where this device's
  bf16 GEMMs run under 1/4 of its fp32 speed (a CPU without AVX-512 BF16 or AMX converts each
  product: 50x slower on an AVX2 EPYC, where bench32m's bf16 row alone took over 20 minutes).
  Returns ({precision: model}, a line saying why)."""
  if device.type != 'cpu' or precisions == ['fp32']:
    return {p: 'bench32m' for p in precisions}, 'model auto: bench32m'
  fp32, bf16 = (devices.measured_matmul_flops(device, dtype, n=512) for dtype in (torch.float32, torch.bfloat16))
  small = bf16 < fp32 / 4
  models = {p: 'bench5m' if small and p != 'fp32' else 'bench32m' for p in precisions}
  return models, (f'model auto: bf16 512^3 matmul {bf16 / 1e9:.1f} GFLOP/s against fp32 {fp32 / 1e9:.1f}: '
                  + ('the 16-bit rows on bench5m, fp32 on bench32m' if small else 'every row on bench32m'))


def define_flags():
  tools.define_list_of('precisions', list(RECIPES), RECIPES, 'Precisions to compare, in order')
  flags.DEFINE_integer('steps', 3, 'Timed steps per side.')
  flags.DEFINE_integer('warmup', 1, 'Untimed warm-up steps per side.')
  flags.DEFINE_integer('threads', 2, 'torch threads.')
  flags.DEFINE_enum('clock', 'wall', list(CLOCKS), 'wall: seconds; cpu: this process\'s CPU seconds '
                    '(a machine shared with other jobs).')
  flags.DEFINE_bool('profile', False, 'Print one flatron step\'s ops by self CPU time per precision (on a GPU '
                    'HF\'s too, and each step\'s GPU busy and idle time).')
  flags.DEFINE_bool('compile', False, 'Both sides regionally compiled: flatron\'s model.compile, HF\'s '
                    'decoder layers each torch.compile\'d (compiles fall in the warm-up).')
  flags.DEFINE_bool('cuda_graph_update', True, 'On a GPU, flatron\'s fused update replayed as one CUDA graph '
                    '(optim/graphed.py); off: launched call by call.')
  flags.DEFINE_bool('keep_freed_host_memory', True, 'CPU: glibc malloc keeps freed blocks for the next step, '
                    'for both sides (train.py\'s keep_freed_host_memory, parallel/device.py); off: glibc as it comes.')
  flags.DEFINE_enum('device', 'cpu', ['cpu', 'cuda', 'auto'], 'Where both sides train (auto: cuda if present).')
  flags.DEFINE_enum('model', 'auto', ['auto', *MODELS], 'The Llama shape (MODELS in tools/bench_hf.py); auto: '
                    'bench32m, and bench5m for the 16-bit rows where bf16 GEMMs run under 1/4 of fp32\'s speed.')
  flags.DEFINE_integer('seq_length', 0, 'Tokens per row (0: the model\'s in MODELS).')
  flags.DEFINE_integer('micro_batch_size', 0, 'Rows per micro batch (0: the model\'s).')
  flags.DEFINE_integer('global_batch_size', 0, 'Rows per step (0: the model\'s).')


def main(argv):
  tools.no_arguments(argv)
  torch.set_num_threads(FLAGS.threads)
  device = devices.resolve(FLAGS.device)
  graphed.ENABLED = FLAGS.cuda_graph_update
  malloc = (FLAGS.keep_freed_host_memory and device.type == 'cpu'
            and devices.keep_freed_host_memory())
  if device.type == 'cuda':
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    peak, source = devices.peak_flops(device)
    measured = devices.measured_matmul_flops(device, torch.bfloat16, n=8192)
    print(f'{torch.cuda.get_device_name(device)}; MFU against {peak / 1e12:.0f} TFLOP/s ({source}); '
          f'measured bf16 8192^3 matmul {measured / 1e12:.0f} TFLOP/s; steps timed in {FLAGS.clock} seconds', flush=True)
  else:
    peak = devices.measured_matmul_flops(device, n=2048)
    print(f'{FLAGS.threads} threads; measured fp32 2048^3 matmul peak {peak / 1e9:.1f} GFLOP/s; '
          f'steps timed in {FLAGS.clock} seconds', flush=True)
  models = {p: FLAGS.model for p in FLAGS.precisions}
  if FLAGS.model == 'auto':
    models, note = auto_models(FLAGS.precisions, device)
    print(note)
  print(f'model {", ".join(sorted(set(models.values())))}; {"compiled per block" if FLAGS.compile else "eager"}'
        + (f'; host malloc: {malloc or "as the C library has it"}' if device.type == 'cpu' else ''))
  print('| precision | HF tok/s | flatron tok/s | ratio | HF MFU | flatron MFU | HF state MiB | flatron state MiB |'
        ' ceiling tok/s (GEMM + attention) | flatron / ceiling | HF / ceiling | peak memory MiB |')
  print('|---|---|---|---|---|---|---|---|---|---|---|---|')
  for precision in FLAGS.precisions:
    config = bench_config(precision, models[precision], FLAGS.seq_length, FLAGS.micro_batch_size,
                          FLAGS.global_batch_size, device.type)
    dtype = torch.float32 if precision == 'fp32' else torch.bfloat16
    # timed between the steps (each op the best of 3 after an untimed call: one sample of a layer's
    # attention, times the layers, moved the ceiling by 20%): the median of them
    r = run(precision, FLAGS.steps, FLAGS.warmup, config=config, clock=FLAGS.clock, profile=FLAGS.profile,
            compile_blocks=FLAGS.compile,
            ceiling=lambda: step_profile.ceiling_step_time(config, dtype, CLOCKS[FLAGS.clock], device))
    flops = flop_count.flops_per_token(config.model, config.data.seq_length)
    ceiling, gemm, attention = r['ceiling']
    tokens = config.data.global_batch_size * config.data.seq_length
    # both sides live in this process: the peak so far, not either side's own
    peak_memory = (torch.cuda.max_memory_allocated(device) if device.type == 'cuda'
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(f"| {precision}{f' ({models[precision]})' if len(set(models.values())) > 1 else ''} | {r['hf']:,.0f} | {r['flatron']:,.0f} | {r['flatron'] / r['hf']:.2f}x | "
          f"{100 * r['hf'] * flops / peak:.1f}% | {100 * r['flatron'] * flops / peak:.1f}% | "
          f"{r['hf_bytes'] / 2**20:.0f} | {r['flatron_bytes'] / 2**20:.0f} | "
          f"{tokens / ceiling:,.0f} (GEMMs {gemm * 1e3:.0f} ms, attention {attention * 1e3:.0f} ms) | "
          f"{r['flatron'] * ceiling / tokens:.0%} | {r['hf'] * ceiling / tokens:.0%} | {peak_memory / 2**20:,.0f} |",
          flush=True)
    if 'profile' in r:
      print(f'flatron {precision} step, ops by self CPU time:\n{r["profile"]}', flush=True)
    if 'hf_profile' in r:
      print(f'HF {precision} step, ops by self CPU time:\n{r["hf_profile"]}', flush=True)
    del r
    if device.type == 'cuda':
      torch.cuda.empty_cache()
      torch.cuda.reset_peak_memory_stats(device)
  meshes.shutdown()


if __name__ == '__main__':
  define_flags()
  app.run(main)
