"""data/stand_in.py: made-up micro batches with the fields, shapes and dtypes of the config's own."""
import json

import torch

from configs import llama_tiny
from data import stand_in
from data.loader import Loader


def _fields(batch):
  return {k: (tuple(v.shape), v.dtype) for k, v in batch.items()}


def _records(path, rows):
  with open(path, 'w', encoding='utf-8') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')
  return str(path)


def test_pretraining_sft_and_preference_stand_ins_match_the_real_loaders(tmp_path):
  c = llama_tiny.get_config('test')
  n = c.data.seq_length
  assert _fields(stand_in.loader(c).global_batch(0)[0]) == _fields(Loader(c).global_batch(0)[0])

  sft = llama_tiny.get_config('test')
  sft.data.train_dir = _records(tmp_path / 'sft.jsonl', [{'input_ids': list(range(1, 6)), 'loss_mask': [1] * 5}] * 8)
  real, made = Loader(sft).global_batch(0)[0], stand_in.loader(sft).global_batch(0)[0]
  assert _fields(made) == _fields(real) and 'segment_ids' in made

  dpo = llama_tiny.get_config('test')
  dpo.model.objective = 'dpo'
  dpo.data.train_dir = _records(tmp_path / 'pairs.jsonl', [{'prompt_input_ids': [1, 2], 'chosen_input_ids': [3],
                                                             'rejected_input_ids': [4, 5]}] * 8)
  real, made = Loader(dpo).global_batch(0)[0], stand_in.loader(dpo).global_batch(0)[0]
  assert _fields(made) == _fields(real)
  assert made['chosen_mask'].sum() > 0 and made['rejected_mask'].sum() > 0 and made['tokens'].shape[1] == n
  assert made['tokens'].dtype == torch.int64
