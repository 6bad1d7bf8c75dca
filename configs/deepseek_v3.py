"""DeepSeek-V3 (671,026,419,200 parameters without its multi-token-prediction layer, 37B active):
61 layers, h 7168, 128 heads of latent attention (q bottleneck 1536, kv latent 512, RoPE 64 of
192 query / key dims, values 128), the first 3 layers dense (18432), then 256 routed experts of
2048 (8 a token, within the best 4 of 8 groups, sigmoid scores, weights x 2.5) and one shared,
YaRN x40 over 4096. The model section is its published config.json's
(tests/fixtures/hf_configs/deepseek_v3_config.json, checked by tests/test_configs.py).

    python -m tools.plan --config=configs/deepseek_v3.py --cluster=h100 --devices=2048 --top=3
    python train.py --config=configs/deepseek_v3.py:smoke --workdir=/tmp/dsv3

As its technical report trains it: sequences of 4096, 15360 a step (after the ramp), the
auxiliary-loss-free balancing at rate 0.001 (its small sequence-wise auxiliary loss and the
multi-token prediction are not built), bf16 compute with fp32 masters (the report's FP8 GEMMs
are precision.fp8's to choose).
"""
from configs import base, presets


def get_config(arg=None):
  c = base.get_config()
  c.name = 'deepseek_v3'
  model = c.model
  model.architecture = 'deepseek_v3'
  model.num_layers, model.hidden_size, model.ffn_hidden_size = 61, 7168, 18432
  model.num_attention_heads, model.num_kv_heads, model.head_dim = 128, 128, 192
  model.vocab_size, model.max_position_embeddings = 129280, 163840
  model.rope_theta, model.layernorm_epsilon = 10000.0, 1e-6
  model.rope_scaling.update(type='yarn', factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
  model.mla.update(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   rope_interleave=True)
  model.moe.update(num_experts=256, top_k=8, num_groups=8, top_k_groups=4, router_activation='sigmoid',
                   load_balance_bias=True, load_balance_rate=0.001, routed_scaling_factor=2.5,
                   normalize_top_k_affinities=True, dropless=True, ffn_hidden_size=2048,
                   shared_expert_intermediate_size=2048, shared_expert_gate=False, dense_layers=(0, 1, 2),
                   output_router_logits=False, router_aux_loss_coef=0.001)
  model.optim.lr, model.optim.weight_decay = 2.2e-4, 0.1
  model.optim.sched.warmup_steps, model.optim.sched.min_lr = 2000, 2.2e-5
  model.activations_checkpoint_granularity = 'full'
  c.precision.type = 'mixed_precision'
  c.data.seq_length, c.data.micro_batch_size, c.data.global_batch_size = 4096, 1, 15360
  c.trainer.max_steps = 100000
  c.trainer.log_every_n_steps = 10
  c.trainer.val_check_interval = 1000
  return presets.apply(c, arg, 'deepseek_v3', smoke=_smoke)


def _smoke(c):
  c = presets.smoke(c)
  c.model.num_layers = 3
  c.model.head_dim = 24
  c.model.mla.update(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
  c.model.moe.update(num_experts=8, top_k=2, num_groups=4, top_k_groups=2, ffn_hidden_size=32,
                     shared_expert_intermediate_size=32, dense_layers=(0,))
  return c
