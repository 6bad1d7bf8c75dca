"""gpt-oss-120b (116,829,156,672 parameters, 5.1B active): 36 layers, h 2880, 64 query heads of
64 with 8 KV heads, sinks, sliding (128) and full layers alternating, 128 experts of 2880 per
layer, top 4, biases everywhere, the clamped SwiGLU, YaRN x32 over a 4096 context. The model
section is its published config.json's (tests/fixtures/hf_configs/gpt_oss_120b_config.json,
checked by tests/test_configs.py); ':20b' is gpt-oss-20b (24 layers, 32 experts).

    python -m tools.plan --config=configs/gpt_oss_120b.py --cluster=h100 --nodes=8 --top=3
    python train.py --config=configs/gpt_oss_120b.py --dry_run \\
        --config.distributed_strategy.expert_model_parallel_size=8 ...
    python train.py --config=configs/gpt_oss_120b.py:smoke --workdir=/tmp/gpt_oss

OpenAI publishes neither its training batch nor its layout: the batch here (1024 x 4096
tokens) is a pretraining-sized choice, to be set to the run's.
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'gpt_oss_120b'
  model = c.model
  model.architecture = 'gpt_oss'
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 36, 2880, 2880
  model.num_attention_heads, model.num_kv_heads, model.head_dim = 64, 8, 64
  model.vocab_size, model.max_position_embeddings = 201088, 131072
  model.rope_theta, model.layernorm_epsilon = 150000.0, 1e-5
  model.rope_scaling.update(type='yarn', factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                            beta_slow=1.0, truncate=False)
  model.sliding_window = 128
  model.layer_types = ('sliding_attention', 'full_attention') * 18
  model.attention_sinks = model.has_bias = model.rmsnorm_scale_in_fp32 = True
  model.moe.update(num_experts=128, top_k=4, dropless=True, normalize_top_k_affinities=True,
                   expert_activation='clamped_swiglu', swiglu_alpha=1.702, swiglu_limit=7.0,
                   output_router_logits=False, router_aux_loss_coef=0.9)
  model.optim.lr, model.optim.weight_decay = 3e-4, 0.1
  model.optim.sched.warmup_steps, model.optim.sched.min_lr = 2000, 3e-5
  model.activations_checkpoint_granularity = 'full'
  c.precision.type = 'mixed_precision'       # bf16 compute, fp32 master weights and optimizer state
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 4096, 1, 1024
  c.trainer.max_steps = 100000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'gpt_oss_120b', smoke=_smoke, **{'20b': _20b})


def _20b(c):
  c.name = 'gpt_oss_20b'
  c.model.num_layers = 24
  c.model.layer_types = ('sliding_attention', 'full_attention') * 12
  c.model.moe.num_experts = 32
  return c


def _smoke(c):
  c = presets.smoke(c)
  c.model.head_dim, c.model.sliding_window = 16, 16
  c.model.layer_types = ('sliding_attention', 'full_attention')
  c.model.moe.num_experts = 4
  c.model.moe.top_k = 2
  return c
