"""parallel/reference.py and preference objectives through the loop: DPO and ORPO at every
layout equal one device; the three DPO references agree; resume is bitwise exact."""
import json
import os

import numpy as np
import pytest

import train
from tests import parity


@pytest.fixture(scope='module')
def pairs_path(tmp_path_factory):
  """Pre-tokenized pairs (rows of 16 tokens): chosen responses from the low ids, rejected from
  the high ones, after prompts of 2-4 tokens."""
  path = tmp_path_factory.mktemp('pairs') / 'pairs.jsonl'
  parity.write_pairs(path, 40, seed=0)
  return str(path)


LAYOUTS = {
    'dpo_tp2': (2, {'tp': 2}),
    'dpo_pp2': (2, {'pp': 2}),
    'dpo_dp2_zero1': (2, {'zero1': True}),
    'dpo_precomputed_pp2': (2, {'pp': 2, 'precompute': True}),
    'dpo_lora_tp2_sp': (2, {'tp': 2, 'sp': True, 'lora': 4}),       # reference = the base, adapters off
    'orpo_tp2': (2, {'tp': 2}),
}


def test_preference_objectives_at_every_layout_train_like_one_device(pairs_path, tmp_path, tmp_path_factory):
  """Every layout, one after another in one spawned world (all are 2 ranks)."""
  layouts = {name: (world_size, dict(kwargs, sft=pairs_path, objective=name.split('_')[0]))
             for name, (world_size, kwargs) in LAYOUTS.items()}
  parity.check_layouts(layouts, tmp_path, tmp_path_factory)


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return [r['loss'] for r in records if 'loss' in r], [r for r in records if 'rewards/accuracies' in r]


def test_precomputed_and_frozen_references_agree_and_rewards_grow(pairs_path, tmp_path):
  runs = {}
  for precompute in (False, True):
    workdir = str(tmp_path / str(precompute))
    train.run(parity.parity_config(sft=pairs_path, objective='dpo', precompute=precompute), workdir)
    runs[precompute] = _losses(workdir)
  np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
  losses, records = runs[False]
  assert losses[0] == pytest.approx(np.log(2), rel=1e-6)      # the policy starts as its reference
  assert records[-1]['rewards/margins'] > records[0]['rewards/margins'] and losses[-1] < losses[0]


def test_dpo_resume_is_bitwise_and_keeps_the_starting_model_as_reference(pairs_path, tmp_path):
  def config(steps, resume):
    c = parity.parity_config(sft=pairs_path, objective='dpo')
    c.trainer.max_steps, c.model.optim.sched.max_steps = steps, 10
    c.exp_manager.create_checkpoint_callback = True
    c.exp_manager.resume_if_exists = c.exp_manager.resume_ignore_no_checkpoint = resume
    return c

  straight, interrupted = str(tmp_path / 'straight'), str(tmp_path / 'interrupted')
  _, params = train.run(config(10, False), straight)
  train.run(config(5, False), interrupted)
  _, resumed = train.run(config(10, True), interrupted)
  assert _losses(interrupted)[0] == _losses(straight)[0]
  for name, p in params.items():
    assert (p == resumed[name]).all(), name
