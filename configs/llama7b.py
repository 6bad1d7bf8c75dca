"""Llama-2 7B (6,738,415,616 parameters): 32 layers, h 4096, 32 heads, SwiGLU 11008, vocab 32000.

    torchrun --nproc_per_node=8 train.py --config=configs/llama7b.py --workdir=runs/l7 \
        --config.distributed_strategy.tensor_model_parallel_size=8
    python train.py --config=configs/llama7b.py:smoke --workdir=/tmp/l7   # same features, CPU-sized

Matches NxD Training's hf_llama2_7B recipe: seq 4096, global batch 1024, lr 3e-4 cosine.
Bring a Llama tokenizer (`--config.data.tokenizer.type=sentencepiece --config.data.tokenizer.model=...`).
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama7b'
  model = c.model
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 32, 4096, 11008
  model.num_attention_heads, model.num_kv_heads = 32, 32
  model.vocab_size, model.max_position_embeddings = 32000, 4096
  model.rope_theta, model.layernorm_epsilon = 10000.0, 1e-5
  model.optim.lr, model.optim.weight_decay = 3e-4, 0.1
  model.optim.sched.warmup_steps, model.optim.sched.min_lr = 2000, 3e-5
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 4096, 1, 1024
  c.trainer.max_steps = 100000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'llama7b', smoke=presets.smoke)
