"""tools/convert.py: HF -> flatron checkpoint -> HF is bit-exact, and the checkpoint trains."""
import os

import torch
from safetensors.torch import load_file

from configs import llama_tiny
from model import hf, transformer
from tools import convert


def test_round_trip_is_bit_exact_and_loadable_by_init_from(tmp_path):
  c = llama_tiny.get_config('test')
  c.model.vocab_size = 300                      # padded to 384 in memory, 300 rows on disk
  params = transformer.init(c.model, 3)
  hf.save_hf(str(tmp_path / 'hf'), c.model, params)
  step = convert.hf_to_flatron(str(tmp_path / 'hf'), str(tmp_path / 'ckpt'))
  assert os.path.basename(step) == 'step_00000000'
  convert.flatron_to_hf(step, str(tmp_path / 'back'))
  before = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  after = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert before.keys() == after.keys()
  for name in before:
    assert torch.equal(before[name], after[name]), name
  assert before['model.embed_tokens.weight'].shape[0] == 300
  # and a run initialized from the converted step starts from exactly those weights
  import train  # pylint: disable=import-outside-toplevel
  c.trainer.max_steps, c.trainer.val_check_interval = 1, 0
  c.model.optim.sched.warmup_steps = 0         # a warm-up needs steps after it
  c.exp_manager.create_tensorboard_logger = False
  c.exp_manager.init_from = step
  c.model.optim.lr, c.trainer.gradient_clip_val = 1e-12, 0.0
  _, trained = train.run(c, str(tmp_path / 'run'))
  for name, value in params.items():
    torch.testing.assert_close(trained[name].detach()[:300], value.detach()[:300], atol=1e-6, rtol=0)
