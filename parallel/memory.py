"""Memory estimate per rank, printed before training so a layout that cannot fit fails early."""
import math

from model import transformer

ADAM_STATES = {'adamw': 2, 'adamw_fp32OptState': 2, 'adam': 2, 'adamax': 2, 'novograd': 1,
               'adadelta': 2, 'adagrad': 1, 'rmsprop': 1, 'rprop': 2, 'sgd': 0, 'adafactor': 1}


def activation_bytes_per_layer(config, bytes_per_value=4) -> int:
  """Values saved for backward by one of our Llama/GPT blocks, no recompute.

  Counted for our block (b micro batch, s seq, h hidden, f ffn, a heads, g kv heads, d head
  dim, fused attention saving q, k, v, output and logsumexp): two norm inputs (2sbh), norm
  outputs feeding q/k/v and the MLP (2sbh), q/k/v and attention output (sb(2a+2g)d), the
  o-projection input (shared with the attention output), MLP: up, gate, silu(gate) and their
  product (4sbf) for SwiGLU or up and gelu(up) (2sbf) for GELU. Dropout masks add sbh each.
  """
  m, a = config.model, config.data
  s, b, h, f = a.seq_length, a.micro_batch_size, m.hidden_size, m.ffn_hidden_size
  d, heads, kv = transformer.head_dim(m), m.num_attention_heads, transformer.kv_heads(m)
  values = 4 * s * b * h + s * b * (2 * heads + 2 * kv) * d
  values += (4 if m.activation == 'swiglu' else 2) * s * b * f
  if not m.fusions.flash_attention or m.attention_dropout > 0:
    values += 2 * b * heads * s * s        # explicit path keeps scores and probabilities
  values += 2 * s * b * h * (m.hidden_dropout > 0)
  if m.activations_checkpoint_granularity == 'full':
    values = s * b * h
  return values * bytes_per_value


def estimate(config, dp=1, bytes_per_value=4) -> dict:
  """Bytes per rank: parameters, gradients, optimizer state, activations (one micro batch)."""
  m = config.model
  n = sum(math.prod(spec.shape) for spec in transformer.param_specs(m).values())
  states = ADAM_STATES.get(m.optim.name, 2)
  logits = config.data.micro_batch_size * config.data.seq_length * transformer.padded_vocab_size(m)
  out = {
      'params': n * bytes_per_value,
      'grads': n * bytes_per_value,
      'optimizer': n * 4 * states,
      'activations': (m.num_layers * activation_bytes_per_layer(config, bytes_per_value)
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
