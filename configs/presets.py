"""Presets selected after ':' in --config=configs/NAME.py:PRESET, and the one parser of that suffix."""


def apply(c, arg, name, **named):
  """`c` changed by the preset `arg`, one of `named` (preset name -> function of the config).

  No preset (None or '') leaves `c` as it is; an unknown one is an error listing the valid ones.
  """
  if not arg:
    return c
  if arg not in named:
    valid = ' or '.join([repr(preset) for preset in named] + ['none'])
    raise ValueError(f'{name}: unknown preset {arg!r}; valid: {valid}')
  return named[arg](c)


def smoke(c):
  """Shrink any model config to a few-second CPU run that keeps its architecture's features."""
  model = c.model
  kv_ratio = model.num_attention_heads // (model.num_kv_heads or model.num_attention_heads)
  model.num_layers = 2
  model.num_attention_heads = 4
  model.num_kv_heads = max(1, 4 // kv_ratio) if model.num_kv_heads else 0
  model.head_dim = 0
  model.hidden_size = 64
  model.ffn_hidden_size = 172
  model.vocab_size = 512
  model.max_position_embeddings = 128
  # The full recipes warm up for thousands of steps: a 10-step run would never reach the peak lr.
  model.optim.sched.warmup_steps = 2
  model.optim.sched.warmup_ratio = None
  c.data.seq_length = 64
  c.data.micro_batch_size = 2
  c.data.global_batch_size = 4
  c.trainer.max_steps = 10
  c.trainer.val_check_interval = 5
  return c
