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
  model = c.model
  model.architecture = 'gpt'
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 24, 1024, 4096
  model.num_attention_heads, model.num_kv_heads = 16, 0
  model.vocab_size, model.max_position_embeddings = 50257, 1024
  model.position_embedding_type = 'learned_absolute'
  model.normalization, model.activation, model.has_bias = 'layernorm', 'gelu', True
  model.share_embeddings_and_output_weights = True
  model.hidden_dropout = model.attention_dropout = 0.1
  model.optim.lr, model.optim.weight_decay, model.optim.betas = 1.5e-4, 0.01, (0.9, 0.95)
  model.optim.sched.warmup_steps, model.optim.sched.min_lr = 2000, 1e-5
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 1024, 4, 512
  c.trainer.max_steps = 500000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'gpt_345m', smoke=presets.smoke)
