"""A 56M-parameter Llama (8 layers, h 512, GQA 8/4, vocab 32000): the CPU benchmark size.

    python -m tools.bench --config=configs/llama_50m.py
    python train.py --config=configs/llama_50m.py --workdir=runs/l50m

Large enough that matmuls dominate on a CPU, small enough for a laptop.
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama_50m'
  model = c.model
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 8, 512, 1408
  model.num_attention_heads, model.num_kv_heads = 8, 4
  model.vocab_size, model.max_position_embeddings = 32000, 1024
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 512, 2, 8
  c.trainer.max_steps = 1000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 200
  return presets.apply(c, arg, 'llama_50m')
