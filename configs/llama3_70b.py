"""Llama-3 70B (70,553,706,496 parameters): 80 layers, h 8192, GQA 64/8, SwiGLU 28672.

    torchrun --nnodes=8 --nproc_per_node=32 train.py --config=configs/llama3_70b.py --workdir=runs/l70 \
        --config.distributed_strategy.tensor_model_parallel_size=32 \
        --config.distributed_strategy.pipeline_model_parallel_size=8 \
        --config.distributed_strategy.kv_replicator=4
    python train.py --config=configs/llama3_70b.py:smoke --workdir=/tmp/l70
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama3_70b'
  model = c.model
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 80, 8192, 28672
  model.num_attention_heads, model.num_kv_heads = 64, 8
  model.vocab_size, model.max_position_embeddings = 128256, 8192
  model.rope_theta, model.layernorm_epsilon = 500000.0, 1e-5
  model.optim.lr, model.optim.weight_decay = 1.5e-4, 0.1
  model.optim.sched.warmup_steps, model.optim.sched.min_lr = 2000, 1.5e-5
  model.activations_checkpoint_granularity = 'full'
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 8192, 1, 1024
  c.trainer.max_steps = 100000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'llama3_70b', smoke=presets.smoke)
