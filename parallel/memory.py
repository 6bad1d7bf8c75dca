"""Memory estimate per rank, printed before training so a layout that cannot fit fails early."""
import math

from model import transformer

ADAM_STATES = {'adamw': 2, 'adamw_fp32OptState': 2, 'adam': 2, 'adamax': 2, 'novograd': 1,
               'adadelta': 2, 'adagrad': 1, 'rmsprop': 1, 'rprop': 2, 'sgd': 0, 'adafactor': 1}


def activation_bytes_per_layer(config, bytes_per_value=4, tp=1) -> int:
  """Values saved for backward by one of our Llama/GPT blocks, no recompute.

  Counted for our block (b micro batch, s seq, h hidden, f ffn, a heads, g kv heads, d head
  dim, fused attention saving q, k, v, output and logsumexp): two norm inputs (2sbh), norm
  outputs feeding q/k/v and the MLP (2sbh), q/k/v and attention output (sb(2a+2g)d), the
  o-projection input (shared with the attention output), MLP: up, gate, silu(gate) and their
  product (4sbf) for SwiGLU or up and gelu(up) (2sbf) for GELU. Dropout masks add sbh each.
  Under TP the attention and MLP internals divide by t; under SP the sbh terms do too.
  """
  m, a = config.model, config.data
  s, b, h, f = a.seq_length, a.micro_batch_size, m.hidden_size, m.ffn_hidden_size
  d, heads, kv = transformer.head_dim(m), m.num_attention_heads, transformer.kv_heads(m)
  seq_shards = tp if config.distributed_strategy.sequence_parallel else 1
  inner = s * b * (2 * heads + 2 * max(kv, tp)) * d + (4 if m.activation == 'swiglu' else 2) * s * b * f
  if not m.fusions.flash_attention or m.attention_dropout > 0:
    inner += 2 * b * heads * s * s         # explicit path keeps scores and probabilities
  values = (4 + 2 * (m.hidden_dropout > 0)) * s * b * h / seq_shards + inner / tp
  if m.activations_checkpoint_granularity == 'full':
    values = s * b * h / seq_shards
  return int(values * bytes_per_value)


def estimate(config, n_params=None, bytes_per_value=4) -> dict:
  """Bytes per rank holding `n_params` parameters: params, grads, optimizer state, activations
  of one micro batch (plus the fp32 logits and their softmax)."""
  m = config.model
  tp = config.distributed_strategy.tensor_model_parallel_size
  if n_params is None:
    n_params = sum(math.prod(spec.shape) for spec in transformer.param_specs(m, tp).values())
  states = ADAM_STATES.get(m.optim.name, 2)
  logits = config.data.micro_batch_size * config.data.seq_length * transformer.padded_vocab_size(m, tp) // tp
  out = {
      'params': n_params * bytes_per_value,
      'grads': n_params * bytes_per_value,
      'optimizer': n_params * 4 * states,
      'activations': (m.num_layers * activation_bytes_per_layer(config, bytes_per_value, tp)
                      + 2 * logits * 4),
  }
  out['total'] = sum(out.values())
  return out


def human_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.1f} {unit}' if unit != 'B' else f'{int(n)} B'
    n /= 1024
  return str(n)
