"""A CPU-sized Llama (GQA, RoPE, SwiGLU, RMSNorm): the demo and test model.

    make train        # Shakespeare + a 4096-piece SentencePiece tokenizer, ~3 minutes on 2 cores
    python train.py --config=configs/llama_tiny.py --workdir=runs/tiny   # synthetic stream
    python train.py --config=configs/llama_tiny.py:test --workdir=/tmp/t   # smaller, for tests

On the synthetic stream (vocab 256) the loss falls from ln(256) ~ 5.5 towards ln(4) ~ 1.4 nats.
On Shakespeare (`make train`) the validation loss ends well below the unigram entropy (~6.2).
"""
from configs import base


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama_tiny'
  m = c.model
  m.num_layers = 4
  m.hidden_size = 128
  m.ffn_hidden_size = 352
  m.num_attention_heads = 4
  m.num_kv_heads = 2
  m.vocab_size = 256
  m.max_position_embeddings = 256
  m.optim.lr = 3e-3
  m.optim.sched.min_lr = 3e-4
  c.data.seq_length = 128
  c.data.micro_batch_size = 4
  c.data.global_batch_size = 16
  c.trainer.max_steps = 600
  c.trainer.log_every_n_steps = 20
  c.trainer.val_check_interval = 100
  c.trainer.limit_val_batches = 4
  if arg == 'test':
    m.num_layers = 2
    m.hidden_size = 32
    m.ffn_hidden_size = 64
    m.max_position_embeddings = 32
    c.data.seq_length = 16
    c.data.micro_batch_size = 2
    c.data.global_batch_size = 8
    c.trainer.max_steps = 10
    c.trainer.log_every_n_steps = 1
    c.trainer.val_check_interval = 5
    c.trainer.limit_val_batches = 2
    c.data.synthetic_vocab_size = 32     # a small chain the small model learns within 30 steps
    m.optim.lr, m.optim.sched.warmup_steps = 1e-2, 3
  elif arg:
    raise ValueError(f"llama_tiny: unknown preset {arg!r}; valid: 'test' or none")
  return c
