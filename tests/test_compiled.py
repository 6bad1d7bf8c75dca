"""model.compile: compiled training steps equal eager ones (dropout and recompute on), the graph
count does not grow with layers or steps, and what cannot compile is refused by name."""
import pytest
import torch

from configs import llama_tiny, mixtral_tiny, validate
from data.loader import Loader
from optim import update
from parallel import compiled, mesh as meshes, tensor, training


def tiny(compile_blocks):
  c = llama_tiny.get_config('test')            # 2 layers x hidden 32, fp32
  c.model.hidden_dropout = c.model.ffn_dropout = c.model.attention_dropout = 0.1
  c.model.activations_checkpoint_granularity = 'full'
  c.model.compile = compile_blocks
  return c


def train(c, steps=3):
  validate.validate(c, 1)
  mesh = meshes.init(c)
  ops = tensor.config_ops(c, mesh)
  params = training.init_params(c, mesh)
  updater = update.Updater(params, c, mesh, training.placement(c, mesh))
  loader = Loader(c, 'train', mesh.dp_rank, mesh.dp)
  losses, graphs = [], []
  for step in range(steps):
    out = training.train_step(params, updater, loader.global_batch(step * c.data.global_batch_size), c, step, mesh,
                              ops)
    losses.append(out['loss'].item())
    graphs.append(compiled.stats()['graphs'])
  return torch.tensor(losses), {n: p.detach().clone() for n, p in params.items()}, graphs


def test_compiled_steps_equal_eager_and_compile_once():
  eager_losses, eager_params, _ = train(tiny(False))
  losses, params, graphs = train(tiny(True))
  # Dropout masks are drawn eagerly from the same keys, so the losses match to the bit in
  # practice; inductor's fused C++ kernels sum reductions (norms, softmax) in another order,
  # a few fp32 ulps per op, which three Adam steps at lr 1e-2 carry to ~1e-6 in the params.
  torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
  for name, p in eager_params.items():
    torch.testing.assert_close(params[name], p, rtol=0, atol=1e-5, msg=name)
  # every layer and every later step reuses the first step's graphs (recompute included)
  assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs


def test_a_block_without_dropout_is_one_graph():
  # a graph break splits the block where inductor cannot fuse across (a ConfigDict's truth test
  # in moe.enabled once split every block in two)
  c = tiny(True)
  c.model.hidden_dropout = c.model.ffn_dropout = c.model.attention_dropout = 0.0
  c.model.activations_checkpoint_granularity = None
  before = compiled.stats()
  train(c, steps=1)
  after = compiled.stats()
  assert after['graph_breaks'] == before['graph_breaks'], (before, after)
  assert after['graphs'] > before['graphs']


@pytest.mark.parametrize('dropless, frequency', [(False, 1), (True, 1), (False, 2)])
def test_moe_compiles_to_one_graph_per_block_and_trains_like_eager(dropless, frequency):
  """MoE traced: the experts run in fixed-size buffers (model/moe.py), so a block is one graph
  with no break and no recompile; the steps equal eager's sorted dispatch."""
  def moe_tiny(compile_blocks):
    c = mixtral_tiny.get_config('test')
    c.model.moe.update(dropless=dropless, capacity_factor=0.5, router_z_loss_coef=0.01,    # tokens drop
                       frequency=frequency)        # 2: layer 0 dense, layer 1 MoE (a graph each)
    c.model.compile = compile_blocks
    return c

  eager_losses, eager_params, _ = train(moe_tiny(False))
  before = compiled.stats()
  losses, params, graphs = train(moe_tiny(True))
  after = compiled.stats()
  torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
  for name, p in eager_params.items():
    torch.testing.assert_close(params[name], p, rtol=0, atol=1e-5, msg=name)
  assert after['graph_breaks'] == before['graph_breaks'], (before, after)
  assert graphs[0] > before['graphs'] and graphs[-1] == graphs[0], graphs


@pytest.mark.parametrize('key, value, message', [
    ('distributed_strategy.tensor_model_parallel_size', 2, 'tensor_model_parallel_size=2'),
    ('device', 'xla', 'device=xla'),
])
def test_what_cannot_compile_is_refused_by_name(key, value, message):
  c = tiny(True)
  c.update_from_flattened_dict({key: value})
  problems = compiled.check(c)
  assert len(problems) == 1 and message in problems[0], problems
  assert 'model.compile' in problems[0]


def test_off_by_default_and_leaves_the_layer_fn_alone():
  c = llama_tiny.get_config('test')
  assert c.model.compile is False and compiled.check(c) == []
  marker = object()
  assert compiled.layer_fn(c.model, torch.device('cpu'), marker) is marker
  with pytest.raises(ValueError, match='model.compile=True on an XLA device'):
    compiled.layer_fn(tiny(True).model, torch.device('xla'), None)


def test_the_compile_backend_comes_from_the_config_and_an_unknown_one_is_refused_by_name():
  c = llama_tiny.get_config('test')
  c.model.compile = True
  assert compiled.check(c) == []
  c.model.compile_backend = 'neuron'      # TorchNeuron's compiler, not installed here
  problem, = compiled.check(c)
  assert problem.startswith("model.compile_backend='neuron': not a torch.compile backend here") and 'plug-in' in problem
  assert any('compile_backend' in p for p in validate.check(c, 1))
