"""flatron against Hugging Face on the same model, side by side in one process, and the ceiling.

    python -m tools.bench_hf                        # the 32M Llama of issue 18, fp32 / mixed / bf16
    python -m tools.bench_hf --precisions=fp32 --steps=3
    python -m tools.bench_hf --precisions=bf16 --clock=cpu --profile   # a shared machine; where time goes

Both sides train the same Llama (transformers' LlamaForCausalLM with torch.optim.AdamW, and
flatron's loop step), from the same weights, on the same token batches, steps interleaved
(HF, flatron, HF, ...) so drift in the machine's speed hits both alike. Per precision:
  fp32   HF fp32                      vs flatron precision.type=fp32
  mixed  HF fp32 under torch.autocast(bf16) vs flatron mixed_precision (bf16 weights, fp32 masters)
  bf16   HF .to(bfloat16)             vs flatron bf16SR (bf16 weights, stochastic rounding)
It prints tok/s, the ratio, MFU (against a measured matmul peak), the bytes of parameters +
gradients + optimizer state each side holds and the process's peak RSS (both sides together), then the ceiling: the step's GEMMs and attention
alone (forward and backward, timed one by one), and the fraction of it each side reaches.
--clock=cpu times steps in this process's CPU seconds (all its threads) instead of wall seconds:
on a machine shared with other jobs, waiting for a core does not count against either side.
--profile prints flatron's step under torch.profiler, the ops by their own CPU time.
--compile compiles both sides per block (flatron's model.compile, each HF decoder layer's
torch.compile); the ceiling stays the eager GEMMs and attention.
"""
import os
import resource
import statistics
import time

from absl import app, flags
import torch
import torch.nn.functional as F

import tools
from configs import llama_tiny
from data.loader import Loader
from model import hf, transformer
from optim import optimizers, update
from parallel import device as devices, mesh as meshes, tensor, training

FLAGS = flags.FLAGS
RECIPES = {'fp32': 'fp32', 'mixed': 'mixed_precision', 'bf16': 'bf16SR'}
CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}


def bench_config(precision):
  """The issue's 32M Llama: h 512, 8 layers, 8 heads / 4 KV, ffn 1408, vocab 8192, seq 256, batch 8."""
  c = llama_tiny.get_config()
  m = c.model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 8, 512, 1408
  m.num_attention_heads, m.num_kv_heads, m.vocab_size = 8, 4, 8192
  m.max_position_embeddings = 256
  m.use_scaled_init_method = False
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 256, 8, 8
  c.precision.type = RECIPES[precision]
  c.trainer.gradient_clip_val = 1.0
  c.model.optim.sched.warmup_steps = 0
  return c


def hf_model(config, params, precision):
  os.environ.setdefault('HF_HUB_OFFLINE', '1')     # read when transformers is first imported
  import transformers  # pylint: disable=import-outside-toplevel
  hf_config = transformers.LlamaConfig(**{k: v for k, v in hf.config_to_hf(config.model).items()
                                          if k not in ('architectures', 'model_type')})
  hf_config._attn_implementation = 'sdpa'  # pylint: disable=protected-access
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
  optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
  return model.train(), optimizer


def hf_step(model, optimizer, micro_batches, precision, clip, lr):
  """One HF training step on flatron's micro batches (the same labels, the same lr); returns the loss."""
  for group in optimizer.param_groups:
    group['lr'] = lr
  total = 0.0
  for mb in micro_batches:
    with torch.autocast('cpu', torch.bfloat16, enabled=precision == 'mixed'):
      logits = model(input_ids=mb['tokens']).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), mb['labels'].flatten()) / len(micro_batches)
    loss.backward()
    total += loss.item()
  torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
  optimizer.step()
  optimizer.zero_grad(set_to_none=True)
  return total


def state_bytes(tensors):
  return sum(t.numel() * t.element_size() for t in tensors)


def ceiling_step_time(config, dtype, repeats=3, clock='wall'):
  """Seconds per step for the step's GEMMs (forward, and both backward products) and SDPA
  forward + backward only, each timed alone (best of `repeats`)."""
  m, d = config.model, config.data
  tokens, hd = d.micro_batch_size * d.seq_length, transformer.head_dim(m)
  heads, kv = m.num_attention_heads, transformer.kv_heads(m)
  shapes = [(heads * hd, m.hidden_size), (kv * hd, m.hidden_size), (kv * hd, m.hidden_size),
            (m.hidden_size, heads * hd), (m.ffn_hidden_size, m.hidden_size), (m.ffn_hidden_size, m.hidden_size),
            (m.hidden_size, m.ffn_hidden_size)] * m.num_layers + [(m.vocab_size, m.hidden_size)]

  def best(fn):
    fn()
    times = []
    for _ in range(repeats):
      start = CLOCKS[clock]()
      fn()
      times.append(CLOCKS[clock]() - start)
    return min(times)

  total = 0.0
  for out_f, in_f in set(shapes):
    x, w, g = torch.randn(tokens, in_f, dtype=dtype), torch.randn(out_f, in_f, dtype=dtype), torch.randn(tokens, out_f, dtype=dtype)
    t = best(lambda: (x @ w.t(), g @ w, g.t() @ x))       # forward, input grad, weight grad
    total += t * shapes.count((out_f, in_f))
  q = torch.randn(d.micro_batch_size, heads, d.seq_length, hd, dtype=dtype, requires_grad=True)
  k = torch.randn(d.micro_batch_size, heads, d.seq_length, hd, dtype=dtype, requires_grad=True)
  v = torch.randn(d.micro_batch_size, heads, d.seq_length, hd, dtype=dtype, requires_grad=True)
  attention = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
  return total + attention * m.num_layers, total, attention * m.num_layers



def profile_step(params, updater, batch, config, step, mesh, ops, rows=15):
  """flatron's step `step` under torch.profiler: the `rows` ops with the most self CPU time."""
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    training.train_step(params, updater, batch, config, step, mesh, ops)['loss'].item()
  return prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=rows)


def run(precision, steps, warmup, config=None, clock='wall', profile=False, compile_blocks=False):
  """Interleaved steps of both sides: tok/s, state bytes and each side's losses. `compile_blocks`:
  flatron's model.compile and torch.compile of each HF decoder layer (regional on both sides;
  the compiles fall in the warm-up steps)."""
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
    for layer in model.model.layers:
      layer.compile()
  loader = Loader(config, 'train', 0, 1)
  times, losses = {'hf': [], 'flatron': []}, {'hf': [], 'flatron': []}
  now = CLOCKS[clock]
  for i in range(steps + warmup):
    batch = loader.global_batch(i * config.data.global_batch_size)
    start = now()
    lr = updater.lr(i)
    losses['hf'].append(hf_step(model, optimizer, batch, precision, config.trainer.gradient_clip_val, lr))
    times['hf'].append(now() - start)
    start = now()
    losses['flatron'].append(training.train_step(params, updater, batch, config, i, mesh, ops)['loss'].item())
    times['flatron'].append(now() - start)
  tokens = config.data.global_batch_size * config.data.seq_length
  hf_params = list(model.parameters())
  hf_optim = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
  result = {name: tokens / statistics.median(t[warmup:]) for name, t in times.items()}
  # parameters + gradients (as each accumulates them) + optimizer state and masters
  result['hf_bytes'] = 2 * state_bytes(hf_params) + state_bytes(hf_optim)
  result['flatron_bytes'] = state_bytes(params.values()) + updater.state_bytes() + updater.grads.bytes()
  result['config'], result['losses'] = config, losses
  if profile:
    result['profile'] = profile_step(params, updater, loader.global_batch(0), config, steps + warmup, mesh, ops)
  return result


def define_flags():
  tools.define_list_of('precisions', list(RECIPES), RECIPES, 'Precisions to compare, in order')
  flags.DEFINE_integer('steps', 5, 'Timed steps per side.')
  flags.DEFINE_integer('warmup', 2, 'Untimed warm-up steps per side.')
  flags.DEFINE_integer('threads', 2, 'torch threads.')
  flags.DEFINE_enum('clock', 'wall', list(CLOCKS), 'wall: seconds; cpu: this process\'s CPU seconds '
                    '(a machine shared with other jobs).')
  flags.DEFINE_bool('profile', False, 'Print one flatron step\'s ops by self CPU time per precision.')
  flags.DEFINE_bool('compile', False, 'Both sides regionally compiled: flatron\'s model.compile, HF\'s '
                    'decoder layers each torch.compile\'d (compiles fall in the warm-up).')


def main(argv):
  tools.no_arguments(argv)
  torch.set_num_threads(FLAGS.threads)
  peak = devices.measured_matmul_flops(torch.device('cpu'), n=2048)
  print(f'{FLAGS.threads} threads; measured fp32 2048^3 matmul peak {peak / 1e9:.1f} GFLOP/s; '
        f'steps timed in {FLAGS.clock} seconds', flush=True)
  print('| precision | HF tok/s | flatron tok/s | ratio | HF MFU | flatron MFU | HF state MiB | flatron state MiB |'
        ' ceiling tok/s (GEMM + attention) | flatron / ceiling | process peak RSS MiB |')
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  for precision in FLAGS.precisions:
    r = run(precision, FLAGS.steps, FLAGS.warmup, clock=FLAGS.clock, profile=FLAGS.profile,
            compile_blocks=FLAGS.compile)
    config = r['config']
    flops = transformer.flops_per_token(config.model, config.data.seq_length)
    dtype = torch.float32 if precision == 'fp32' else torch.bfloat16
    ceiling, gemm, attention = ceiling_step_time(config, dtype, clock=FLAGS.clock)
    tokens = config.data.global_batch_size * config.data.seq_length
    print(f"| {precision} | {r['hf']:,.0f} | {r['flatron']:,.0f} | {r['flatron'] / r['hf']:.2f}x | "
          f"{100 * r['hf'] * flops / peak:.1f}% | {100 * r['flatron'] * flops / peak:.1f}% | "
          f"{r['hf_bytes'] / 2**20:.0f} | {r['flatron_bytes'] / 2**20:.0f} | "
          f"{tokens / ceiling:,.0f} (GEMMs {gemm * 1e3:.0f} ms, attention {attention * 1e3:.0f} ms) | "
          f"{r['flatron'] * ceiling / tokens:.0%} | "
          # both sides live in this process: the peak so far, not either side's own
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} |", flush=True)
    if 'profile' in r:
      print(f'flatron {precision} step, ops by self CPU time:\n{r["profile"]}', flush=True)
  meshes.shutdown()


if __name__ == '__main__':
  define_flags()
  app.run(main)
