"""A 56M-parameter Llama (8 layers, h 512, GQA 8/4, vocab 32000): the CPU benchmark size.

    python tools/bench.py --config=configs/llama_50m.py
    python train.py --config=configs/llama_50m.py --workdir=runs/l50m

Large enough that matmuls dominate on a CPU, small enough for a laptop.
"""
from configs import base


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama_50m'
  m = c.model
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 8, 512, 1408
  m.num_attention_heads, m.num_kv_heads = 8, 4
  m.vocab_size, m.max_position_embeddings = 32000, 1024
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 512, 2, 8
  c.trainer.max_steps = 1000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 200
  if arg:
    raise ValueError(f"llama_50m: unknown preset {arg!r}; valid: none")
  return c
