"""Llama-3 8B (8,030,261,248 parameters): 32 layers, h 4096, GQA 32/8, SwiGLU 14336, vocab 128256.

    torchrun --nproc_per_node=8 train.py --config=configs/llama3_8b.py --workdir=runs/l3 \
        --config.distributed_strategy.tensor_model_parallel_size=8
    python train.py --config=configs/llama3_8b.py:smoke --workdir=/tmp/l3

As NxD Training's hf_llama3_8B recipe: seq 8192, global batch 1024, rope_theta 500000.
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama3_8b'
  model = c.model
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 32, 4096, 14336
  model.num_attention_heads, model.num_kv_heads = 32, 8
  model.vocab_size, model.max_position_embeddings = 128256, 8192
  model.rope_theta, model.layernorm_epsilon = 500000.0, 1e-5
  model.optim.lr, model.optim.weight_decay = 1.5e-4, 0.1
  model.optim.sched.warmup_steps, model.optim.sched.min_lr = 2000, 1.5e-5
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 8192, 1, 1024
  c.trainer.max_steps = 100000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'llama3_8b', smoke=presets.smoke)
