"""Shared presets selected after ':' in --config=configs/NAME.py:PRESET."""


def smoke(c):
  """Shrink any model config to a few-second CPU run that keeps its architecture's features."""
  m = c.model
  kv_ratio = m.num_attention_heads // (m.num_kv_heads or m.num_attention_heads)
  m.num_layers = 2
  m.num_attention_heads = 4
  m.num_kv_heads = max(1, 4 // kv_ratio) if m.num_kv_heads else 0
  m.head_dim = 0
  m.hidden_size = 64
  m.ffn_hidden_size = 172
  m.vocab_size = 512
  m.max_position_embeddings = 128
  c.data.seq_length = 64
  c.data.micro_batch_size = 2
  c.data.global_batch_size = 4
  c.trainer.max_steps = 10
  c.trainer.val_check_interval = 5
  return c


def apply(c, arg, name):
  if arg is None or arg == '':
    return c
  if arg == 'smoke':
    return smoke(c)
  raise ValueError(f"{name}: unknown preset {arg!r}; valid: 'smoke' or none")
