"""The start-up memory estimate."""
from configs import llama7b, llama_tiny
from model import transformer
from parallel import memory


def test_static_bytes_follow_the_parameter_count():
  c = llama_tiny.get_config()
  n = sum(spec.shape[0] * (spec.shape[1] if len(spec.shape) > 1 else 1)
          for spec in transformer.param_specs(c.model).values())
  est = memory.estimate(c)
  assert est['params'] == est['grads'] == 4 * n
  assert est['optimizer'] == 8 * n                     # AdamW: two fp32 moments
  c.model.optim.name = 'sgd'
  assert memory.estimate(c)['optimizer'] == 0
  assert est['total'] == sum(v for k, v in est.items() if k != 'total')


def test_full_recompute_keeps_only_layer_inputs():
  c = llama7b.get_config()
  s, b, h = c.data.seq_length, c.data.micro_batch_size, c.model.hidden_size
  c.model.activations_checkpoint_granularity = 'full'
  assert memory.activation_bytes_per_layer(c, 2) == 2 * s * b * h
  c.model.activations_checkpoint_granularity = None
  assert memory.activation_bytes_per_layer(c, 2) > 10 * 2 * s * b * h


def test_human_bytes():
  assert memory.human_bytes(512) == '512 B'
  assert memory.human_bytes(3 * 1024**3) == '3.0 GiB'
