"""Supervised fine-tuning of SmolLM2-135M-Instruct (a real pretrained chat model) on real
conversations: the `make sft` demo.

    make sft                                         # fetches model + data, fine-tunes, reports
    python -m tools.sft_demo > .data/sft_args        # or by hand: prepare, then
    python train.py --config=configs/smollm2_sft.py --workdir=runs/sft $(cat .data/sft_args)
    python -m tools.sft_demo --report runs/sft       # held-out loss and replies, before and after

The architecture comes from the model's own config.json (`model_source=hf`) and the weights
from its directory (`exp_manager.init_from`); records are chat messages rendered with the
model's ChatML template, loss on the assistant turns only, packed into rows of 192 tokens.
The paths below are where tools/sft_demo.py puts things (relative to the repository root).
"""
from configs import base, presets

MODEL_DIR = '.data/models/smollm2-135m-instruct'
DATA_DIR = '.data/chitchat'


def get_config(arg=None):
  c = base.get_config()
  c.name = 'smollm2_sft'
  c.model_source = 'hf'
  c.model.model_config = MODEL_DIR + '/config.json'
  c.exp_manager.init_from = MODEL_DIR
  c.exp_manager.create_checkpoint_callback = True          # the final step, for tools/generate.py
  c.exp_manager.checkpoint_callback_params.save_top_k = 1
  c.data.train_dir = DATA_DIR + '/train.jsonl'
  c.data.val_dir = DATA_DIR + '/val.jsonl'
  c.data.tokenizer.type = 'huggingface'
  c.data.tokenizer.model = MODEL_DIR + '/tokenizer.json'
  c.data.seq_length = 192
  c.data.micro_batch_size = 2
  c.data.global_batch_size = 4
  # fp32: on a CPU without bf16 instructions (AVX2 only) autocast's bf16 matmuls run ~5x
  # slower than fp32; on one with AVX512-BF16/AMX (or a GPU) use precision.type=autocast.
  c.precision.type = 'fp32'
  c.model.optim.lr = 1e-4
  c.model.optim.weight_decay = 0.0
  c.model.optim.sched.name = 'CosineAnnealing'
  c.model.optim.sched.warmup_steps = 3
  c.model.optim.sched.min_lr = 1e-5
  c.trainer.max_steps = 16
  c.trainer.log_every_n_steps = 2
  c.trainer.val_check_interval = 16
  c.trainer.limit_val_batches = 4          # 16 held-out rows (about 20 conversations)
  c.trainer.num_sanity_val_steps = 4       # the same rows before training: the "before" loss
  return presets.apply(c, arg, 'smollm2_sft')
