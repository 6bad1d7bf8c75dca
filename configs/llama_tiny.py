"""A CPU-sized Llama (GQA, RoPE, SwiGLU, RMSNorm): the demo and test model.

    make train        # Shakespeare + a 4096-piece SentencePiece tokenizer, ~3 minutes on 2 cores
    python train.py --config=configs/llama_tiny.py --workdir=runs/tiny   # synthetic stream
    python train.py --config=configs/llama_tiny.py:test --workdir=/tmp/t   # smaller, for tests

On the synthetic stream (vocab 256) the loss falls from ln(256) ~ 5.5 towards ln(4) ~ 1.4 nats.
On Shakespeare (`make train`) the validation loss ends well below the unigram entropy (~6.2).
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'llama_tiny'
  model = c.model
  model.num_layers = 4
  model.hidden_size = 128
  model.ffn_hidden_size = 352
  model.num_attention_heads = 4
  model.num_kv_heads = 2
  model.vocab_size = 256
  model.max_position_embeddings = 256
  model.optim.lr = 3e-3
  model.optim.sched.min_lr = 3e-4
  c.data.seq_length = 128
  c.data.micro_batch_size = 4
  c.data.global_batch_size = 16
  c.trainer.max_steps = 600
  c.trainer.log_every_n_steps = 20
  c.trainer.val_check_interval = 100
  c.trainer.limit_val_batches = 4
  return presets.apply(c, arg, 'llama_tiny', test=_test)


def _test(c):
  """Smaller and shorter, for the test suite."""
  model = c.model
  model.num_layers = 2
  model.hidden_size = 32
  model.ffn_hidden_size = 64
  model.max_position_embeddings = 32
  c.data.seq_length = 16
  c.data.micro_batch_size = 2
  c.data.global_batch_size = 8
  c.trainer.max_steps = 10
  c.trainer.log_every_n_steps = 1
  c.trainer.val_check_interval = 5
  c.trainer.limit_val_batches = 2
  c.data.synthetic_vocab_size = 32     # a small chain the small model learns within 30 steps
  model.optim.lr, model.optim.sched.warmup_steps = 1e-2, 3
  return c
