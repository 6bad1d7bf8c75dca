"""DPO of SmolLM2-135M-Instruct with LoRA on preference pairs derived from real conversations:
`make dpo`.

    make dpo
    python -m tools.dpo_demo > .data/dpo_args     # or by hand
    python train.py --config=configs/smollm2_dpo.py --workdir=runs/dpo $(cat .data/dpo_args)
    python -m tools.dpo_demo --report runs/dpo

The policy is the base plus rank-16 LoRA adapters; the reference is the same base with the
adapters switched off, so DPO costs no memory for a second model. Each row holds one pair
(prompt + chosen, prompt + rejected, attention kept apart), so a pair never splits across
micro batches or pipeline stages.
"""
from configs import presets, smollm2_lora


def get_config(arg=None):
  c = smollm2_lora.get_config()
  c.name = 'smollm2_dpo'
  c.model.objective = 'dpo'
  c.model_alignment_strategy.dpo.kl_beta = 0.1
  c.model_alignment_strategy.dpo.max_prompt_length = 96
  c.model_alignment_strategy.peft.lora_dropout = 0.0
  c.data.seq_length = 256
  c.model.optim.lr = 5e-4
  c.model.optim.sched.min_lr = 5e-5
  c.trainer.max_steps = 16
  c.trainer.log_every_n_steps = 2
  c.trainer.val_check_interval = 16
  c.trainer.limit_val_batches = 4          # 16 held-out pairs
  c.trainer.num_sanity_val_steps = 4       # the same pairs before training
  return presets.apply(c, arg, 'smollm2_dpo')
