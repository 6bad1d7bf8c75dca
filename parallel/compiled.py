"""model.compile: regional torch.compile, one transformer block at a time (torchtitan's choice).

One compiled function serves every layer (two more: the last norm and the per-token
cross-entropy, `loss_ops`). Its arguments are the layer's parameters renamed to layer 0
(`layers.7.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight`), the block's input and the
shared rope/mask tensors; the layer index inside the dropout key travels as a tensor. Layers
share shapes, so dynamo traces once (once more for evaluation, under no_grad) and every other
call only checks guards: the graph count does not grow with layers or steps. Layers that
differ (LoRA on some layers only, sliding vs full attention masks, MoE or dense, RoPE or none)
get a graph each, through guards: what differs reaches the block as an argument, never through
a branch on the layer index, which the graph would freeze at layer 0's.

What runs inside the graph and what does not:
  * activation recompute: the checkpoint wraps the compiled block (full), or runs inside it
    (selective: dynamo traces torch.utils.checkpoint); recompute reruns the compiled forward.
  * dropout: the keyed masks are drawn eagerly (`layers.untraced_keep_mask`, set here),
    so they are bitwise the eager masks; the multiply is in the graph.
  * precision: the recipe's autocast (or none) is entered around the stage, outside; dynamo
    traces the ops under it.
  * tensor parallelism: refused (check): a block's collectives are in-place torch.distributed
    calls inside autograd Functions; that dynamo traces them exactly (gloo, CPU) is not shown.
  * XLA: refused (check): torch-xla compiles the whole step itself.
  * the loss: the local per-token cross-entropy over the logits (tp = 1, unchunked) is compiled
    too (model/cross_entropy.traced): one fused pass each way over the logits, where eager
    (model/cross_entropy.per_token) makes their fp32 copy, the log-softmax, and in backward
    the gradient in place and the cast back (8k vocab, bf16, 2,048 tokens on two cores:
    autograd's graph 107 ms, compiled 28). Chunked cross-entropy stays eager.
Generation (`decode`, a KV cache) always runs eagerly.
"""
import dataclasses
import sys

import torch

from model import cross_entropy, layers, transformer

_state = {'fn': None, 'cross_entropy': None, 'norm': None, 'loss_ops': {}}
# dynamo's timers of a frame's compile, and of the backward graph's (compiled at the first backward)
COMPILE_TIMERS = ('_compile.compile_inner', 'backward._backward_impl')


def check(config) -> list:
  """Problems with model.compile, each naming the key that conflicts and the fix."""
  problems = []
  if not config.model.compile:
    return problems
  if config.device == 'xla':
    problems.append('model.compile=True with device=xla: torch-xla compiles the whole step into one graph '
                    'already; set model.compile=False')
  backend = config.model.get('compile_backend', 'inductor')
  if backend != 'inductor' and backend not in torch._dynamo.list_backends(exclude_tags=()):  # pylint: disable=protected-access
    problems.append(f'model.compile_backend={backend!r}: not a torch.compile backend here '
                    f'({", ".join(torch._dynamo.list_backends())}); a PyTorch plug-in registers its own '  # pylint: disable=protected-access
                    '(install it) or use inductor')
  if config.distributed_strategy.tensor_model_parallel_size > 1:
    problems.append(f'model.compile=True with distributed_strategy.tensor_model_parallel_size='
                    f'{config.distributed_strategy.tensor_model_parallel_size} is not supported: a block\'s TP '
                    'collectives (in-place torch.distributed calls inside autograd Functions, gloo on CPU) are not '
                    'shown to trace exactly; set model.compile=False or tensor_model_parallel_size=1')
  return problems


def _block(params, layer, x_bsh, cfg, ops):
  return transformer.block(params, layer, x_bsh, cfg, ops)


def _compiled(backend='inductor'):
  """The block compiled by model.compile_backend's compiler (one per backend)."""
  if _state['fn'] is None or _state['fn'][0] != backend:
    layers.untraced_keep_mask = torch.compiler.disable(layers._keep_mask)  # pylint: disable=protected-access
    # dynamic=False: every layer and step has the same shapes; a changed shape (evaluation at
    # another micro batch size) is a recompile, not a dynamic-shape graph for all.
    _state['fn'] = backend, torch.compile(_block, dynamic=False, backend=backend)
  return _state['fn'][1]


def _canonical(cfg, i):
  """The layer index the graph is traced at: 0 for every layer (what differs between layers, MoE
  or dense, RoPE or none, the mask, comes in as arguments), unless the block's arithmetic depends on
  the index (Megatron's query-key layer scaling divides by it): then its own."""
  return i if cfg.apply_query_key_layer_scaling else 0


def _local_params(params, i, index):
  prefix, renamed = f'layers.{i}.', f'layers.{index}.'
  return {renamed + n[len(prefix):]: t for n, t in params.items() if n.startswith(prefix)}


class Blocks:
  """The model's `layer_fn` with model.compile: the compiled block, inside `wrap` (the recompute
  policy's layer_fn, e.g. a checkpoint) when given."""

  def __init__(self, wrap=None, num_layers=0, backend='inductor'):
    self.wrap, self.backend = wrap or layers.no_recompute, backend
    if num_layers:            # a graph per layer (query-key layer scaling): room for train + eval graphs
      limit = 2 * num_layers + 8
      torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)

  def __call__(self, fn, params, layer, x_bsh, cfg, ops):
    if fn is not transformer.block or layer.kv is not None:
      return self.wrap(fn, params, layer, x_bsh, cfg, ops)
    i, index, drop_key = layer.index, _canonical(cfg, layer.index), layer.drop_key
    if drop_key and drop_key[-1] == i:        # stage keys each layer's dropout by (..., i)
      drop_key = drop_key[:-1] + (torch.tensor(i),)
    return self.wrap(_compiled(self.backend), _local_params(params, i, index),
                     layer._replace(index=index, drop_key=drop_key), x_bsh, cfg, ops)


def _final_norm(params, prefix, x_bsh, cfg):
  """layers.norm compiled, given only its own parameters (not the whole dict to guard on)."""
  own = {n: params[n] for n in (prefix + '.weight', prefix + '.bias') if n in params}
  return _state['norm'](own, prefix, x_bsh, cfg)


def loss_ops(model_cfg, ops):
  """`ops` with the model's last norm and the per-token cross-entropy compiled where
  model.compile is on and the cross-entropy is the local one (a vocab-parallel one has
  collectives; TP is refused above anyway). Eager, the last norm's RMSNorm is five passes each
  way over the micro batch's activations (~6 ms a step of bench_hf's 32M model)."""
  if not model_cfg.get('compile') or ops.cross_entropy is not layers.LOCAL_OPS.cross_entropy:
    return ops
  if _state['cross_entropy'] is None:
    backend = model_cfg.get('compile_backend', 'inductor')
    _state['cross_entropy'] = torch.compile(cross_entropy.traced, dynamic=False, backend=backend)
    _state['norm'] = torch.compile(layers.norm, dynamic=False, backend=backend)
  # the same Ops object each step: the compiled blocks take it as an argument
  cached = _state['loss_ops'].get(id(ops))
  if cached is None or cached[0] is not ops:
    cached = _state['loss_ops'][id(ops)] = ops, dataclasses.replace(ops, cross_entropy=_state['cross_entropy'],
                                                                     final_norm=_final_norm)
  return cached[1]


def _graphs():
  if 'torch._dynamo' not in sys.modules:      # nothing compiled, and plain runs need not import it
    return 0
  from torch._dynamo.utils import counters  # pylint: disable=import-outside-toplevel
  return counters['stats']['unique_graphs']


def layer_fn(model_cfg, device, wrap=None):
  """`wrap` (the recompute layer_fn or None) as it is, or inside Blocks with model.compile."""
  if not model_cfg.get('compile'):
    return wrap
  if device.type == 'xla':
    raise ValueError('model.compile=True on an XLA device: torch-xla compiles the whole step already; '
                     'set model.compile=False')
  return Blocks(wrap, model_cfg.num_layers if model_cfg.apply_query_key_layer_scaling else 0,
                model_cfg.get('compile_backend', 'inductor'))


def stats() -> dict:
  """graphs: dynamo graphs compiled in this process (all blocks, train and eval); graph_breaks:
  where dynamo split a function into more graphs (each one a boundary inductor cannot fuse
  across; keyed dropout's eager mask is one by design); compile_s: seconds dynamo and inductor
  spent compiling them, forward and backward graphs."""
  if 'torch._dynamo' not in sys.modules:
    return {'graphs': 0, 'graph_breaks': 0, 'compile_s': 0.0}
  from torch._dynamo.utils import compilation_time_metrics, counters  # pylint: disable=import-outside-toplevel
  return {'graphs': _graphs(), 'graph_breaks': sum(counters['graph_break'].values()),
          'compile_s': sum(sum(compilation_time_metrics.get(k, ())) for k in COMPILE_TIMERS)}
