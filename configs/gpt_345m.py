"""Megatron GPT-2 345M: learned absolute positions, LayerNorm, GELU, biases, tied embeddings.

    python train.py --config=configs/gpt_345m.py --workdir=runs/gpt \
        --config.data.tokenizer.type=gpt2 --config.data.tokenizer.vocab_file=vocab.json \
        --config.data.tokenizer.merge_file=merges.txt
    python train.py --config=configs/gpt_345m.py:smoke --workdir=/tmp/gpt

Megatron-LM's examples/gpt3 345M settings: 24 layers, h 1024, 16 heads, seq 1024, vocab 50257
padded to 50304, dropout 0.1, lr 1.5e-4 cosine to 1e-5.
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'gpt_345m'
  m = c.model
  m.architecture = 'gpt'
  m.num_layers, m.hidden_size, m.ffn_hidden_size = 24, 1024, 4096
  m.num_attention_heads, m.num_kv_heads = 16, 0
  m.vocab_size, m.max_position_embeddings = 50257, 1024
  m.position_embedding_type = 'learned_absolute'
  m.normalization, m.activation, m.has_bias = 'layernorm', 'gelu', True
  m.share_embeddings_and_output_weights = True
  m.hidden_dropout = m.attention_dropout = 0.1
  m.optim.lr, m.optim.weight_decay, m.optim.betas = 1.5e-4, 0.01, (0.9, 0.95)
  m.optim.sched.warmup_steps, m.optim.sched.min_lr = 2000, 1e-5
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 1024, 4, 512
  c.trainer.max_steps = 500000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'gpt_345m')
