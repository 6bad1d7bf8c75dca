"""LoRA fine-tuning of SmolLM2-135M-Instruct on the `make sft` conversations: `make lora`.

    make lora
    python train.py --config=configs/smollm2_lora.py --workdir=runs/lora $(cat .data/sft_args)

configs/smollm2_sft.py with the base frozen and rank-16 adapters on every linear layer
(model_alignment_strategy.peft, NxD Training's keys). Checkpoints hold the adapters and their
optimizer state only; the base comes from exp_manager.init_from on resume, and
`python -m tools.convert export-peft` hands the adapter to peft as it is.
"""
from configs import presets, smollm2_sft


def get_config(arg=None):
  c = smollm2_sft.get_config()
  c.name = 'smollm2_lora'
  peft = c.model_alignment_strategy.peft
  peft.lora_rank = 16
  peft.lora_alpha = 32.0
  peft.lora_dropout = 0.05
  peft.lora_bias = 'none'
  peft.target_modules = ('qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj')
  c.model.optim.lr = 1e-3                  # adapters start at zero: LoRA takes a larger step
  c.model.optim.sched.min_lr = 1e-4
  return presets.apply(c, arg, 'smollm2_lora')
