"""Context parallelism: the batch slices, the config checks, and every cp layout trains like
one device (gloo, fp32, >= 10 steps, the layout-parity bounds of tests/parity.py)."""
import json

import numpy as np
import pytest
import torch

from configs import llama_tiny, validate
from parallel import context, ring_blocks
from tests import parity, world

LAYOUTS = {
    'cp2': (2, {'cp': 2}),
    'cp2_tp2_sp': (4, {'cp': 2, 'tp': 2, 'sp': True}),
    'cp2_dp2_zero1': (4, {'cp': 2, 'zero1': True}),
    'cp2_pp2': (4, {'cp': 2, 'pp': 2}),
    'cp2_mistral_window': (2, {'cp': 2, 'family': 'mistral'}),   # window 5 of 16: ring steps skipped
    'cp2_lora': (2, {'cp': 2, 'lora': 4}),                         # adapters' gradients summed over cp too
    # MoE dropping past capacity: each expert's queue runs over the whole row, across the slices
    'cp2_moe_capacity': (2, {'cp': 2, 'moe': 4, 'capacity': 1.0}),
    # hidden and ffn dropout: each rank applies its positions of the whole row's keyed mask
    'cp2_dropout': (2, {'cp': 2, 'dropout': 0.1, 'attention_dropout': 0.0}),
    'cp2_lora_dropout': (2, {'cp': 2, 'lora': 4, 'lora_dropout': 0.1}),
    # cut to cp's positions first, then SP's slice of them
    'cp2_tp2_sp_dropout': (4, {'cp': 2, 'tp': 2, 'sp': True, 'dropout': 0.1, 'attention_dropout': 0.0}),
}
# Preference pairs: every cp rank holds a slice of each row; the per-row log-prob sums are
# all-reduced over cp before the sigmoid (the reference's too, precomputed or not).
PAIR_LAYOUTS = {
    'cp2_dpo': (2, {'cp': 2, 'objective': 'dpo'}),
    'cp2_dpo_precomputed': (2, {'cp': 2, 'objective': 'dpo', 'precompute': True}),
    'cp2_orpo': (2, {'cp': 2, 'objective': 'orpo'}),
    'cp2_orpo_token_nll': (2, {'cp': 2, 'objective': 'orpo', 'nll_reduction': 'token'}),
    'cp2_dpo_tp2_sp': (4, {'cp': 2, 'tp': 2, 'sp': True, 'objective': 'dpo'}),    # row sums beside TP's vocab sums
}


# Packed SFT rows with masked prompts: documents start and end inside the cp chunks.
SFT_LAYOUTS = {
    'cp2_sft': (2, {'cp': 2}),
    'cp2_sft_mistral': (2, {'cp': 2, 'family': 'mistral'}),
}


@pytest.fixture(scope='module')
def pairs_path(tmp_path_factory):
  """Pre-tokenized pairs (rows of 16 tokens: prompt, chosen and rejected responses cross the
  cp chunks' boundaries)."""
  path = tmp_path_factory.mktemp('pairs') / 'pairs.jsonl'
  parity.write_pairs(path, 40, seed=0)
  return str(path)


@pytest.fixture(scope='module')
def packed_records(tmp_path_factory):
  """Pre-tokenized records of 3-24 tokens (seq_length 16): packed several to a row, so
  documents start and end inside the cp chunks; prompts masked."""
  generator = np.random.default_rng(11)
  rows = []
  for _ in range(48):
    n = int(generator.integers(3, 25))
    prompt = int(generator.integers(1, n))
    rows.append({'input_ids': generator.integers(0, 32, n).tolist(), 'loss_mask': [0] * prompt + [1] * (n - prompt)})
  path = tmp_path_factory.mktemp('sft') / 'records.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


@pytest.mark.parametrize('world_size', parity.world_sizes({**LAYOUTS, **PAIR_LAYOUTS, **SFT_LAYOUTS}))
def test_layouts_train_like_one_device(world_size, pairs_path, packed_records, tmp_path, tmp_path_factory):
  """Every layout of one world size (plain, preference pairs, packed SFT rows), one after
  another in one spawned world."""
  layouts = {**LAYOUTS, **{name: (size, dict(kwargs, sft=pairs_path)) for name, (size, kwargs) in PAIR_LAYOUTS.items()},
             **{name: (size, dict(kwargs, sft=packed_records)) for name, (size, kwargs) in SFT_LAYOUTS.items()}}
  parity.check_layouts(parity.of_size(layouts, world_size), tmp_path, tmp_path_factory)


def test_slices_follow_the_load_balanced_layout():
  b, s = 2, 8
  batch = {'tokens': torch.arange(b * s).view(b, s), 'labels': torch.arange(b * s).view(b, s) + 1,
           'loss_mask': torch.ones(b, s), 'segment_ids': torch.tensor([[0] * 3 + [1] * 5] * b),
           'sample_ids': torch.tensor([4, 5])}
  first, second = (context.slice_batch(batch, 2, r) for r in range(2))
  assert first['tokens'][0].tolist() == [0, 1, 6, 7] and second['tokens'][0].tolist() == [2, 3, 4, 5]
  assert first['position_ids'][0].tolist() == [0, 1, 6, 7]          # RoPE positions of the chunks
  assert first['labels'][1].tolist() == [9, 10, 15, 16]
  assert first['segment_ids'][0].tolist() == [0, 0, 1, 1]
  assert first['ring_segment_ids'][0].tolist() == [0, 0, 1, 1, 0, 1, 1, 1]   # rank 0's, then rank 1's
  assert torch.equal(first['sample_ids'], batch['sample_ids'])
  assert context.slice_batch(batch, 1, 0) is batch


def test_what_does_not_compose_is_refused_by_name():
  c = llama_tiny.get_config('test')
  d = c.distributed_strategy
  d.context_parallel_size = 2
  c.data.seq_length = 18
  c.model.attention_dropout = 0.1
  c.model.compile = True
  c.model.rope_scaling.type = 'longrope'          # short or long factors by the longest position
  problems = '\n'.join(validate.check(c, 2))
  for needed in ('model.fusions.ring_attention=True', 'divisible by 2 x context_parallel_size = 4',
                 'model.attention_dropout=0.1', 'model.compile=True', "model.rope_scaling.type='longrope'"):
    assert needed in problems, needed
  c.model.fusions.ring_attention, c.data.seq_length, c.model.attention_dropout, c.model.compile = True, 16, 0.0, False
  c.model.rope_scaling.type = 'yarn'              # fixed frequencies: exact under cp
  assert validate.check(c, 2) == []
  assert 'launch a multiple of 2' in '\n'.join(validate.check(c, 3))
  # MoE's fixed-size buffers place tokens by their queue in the slice, capacity by the whole row's
  c.model.moe.update(num_experts=4, top_k=2, dropless=False, fixed_buffers=True)
  assert 'model.moe.fixed_buffers=True with model.moe.dropless=False and distributed_strategy.context_parallel_size=2' \
      in '\n'.join(validate.check(c, 2))
  c.model.moe.update(num_experts=0, fixed_buffers=False)
  c.model.hidden_dropout = c.model.ffn_dropout = 0.1          # exact under cp: accepted
  c.model_alignment_strategy.peft.lora_rank, c.model_alignment_strategy.peft.lora_dropout = 4, 0.1
  c.model.objective, c.data.train_dir = 'dpo', 'pairs'
  assert validate.check(c, 2) == []
  d.context_parallel_size = 1
  c.model.objective = 'next_token'
  assert validate.check(c, 1) == [] and 'does nothing' in validate.warnings(c)[0]


def _dropout_masks_at_cp2():
  from model import layers  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes, tensor  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  c.distributed_strategy.context_parallel_size, c.model.fusions.ring_attention = 2, True
  ops = tensor.make_ops(meshes.init(c))
  x = torch.ones(2, 8, 3)
  return layers.dropout(x, 0.5, (0, 'dropout', 'site'), torch.tensor([3, 7]), ops=ops)


def test_a_cp_rank_applies_its_positions_of_the_whole_rows_dropout_mask():
  from model import layers  # pylint: disable=import-outside-toplevel
  whole = layers.dropout(torch.ones(2, 16, 3), 0.5, (0, 'dropout', 'site'), torch.tensor([3, 7]))
  ranks = world.run(_dropout_masks_at_cp2, 2)
  for r, part in enumerate(ranks):
    assert torch.equal(part, whole[:, ring_blocks.layout_indices(16, 2)[r]])


def _activation_bytes_at_cp2():
  from tests import test_remat  # pylint: disable=import-outside-toplevel
  from estimates import activations  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes  # pylint: disable=import-outside-toplevel
  mesh, out = None, []
  for shape in ('llama_gqa', 'gpt_b1'):
    for mode in test_remat.MODES:
      for flash in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
          c = test_remat.config(shape, mode, flash, dropout=0.0)
          c.distributed_strategy.context_parallel_size, c.model.fusions.ring_attention = 2, True
          mesh = mesh or meshes.init(c)
          measured = activations.measured_bytes_per_layer(c, mesh, dtype)
          formula = activations.activation_bytes_per_layer(c, 4 if dtype == torch.float32 else 2)
          out.append((shape, mode, flash, str(dtype), measured, formula))
  return out


def test_activation_bytes_per_rank_at_cp2_equal_the_formula():
  """What autograd keeps per layer on each cp rank, measured, is the formula with s / cp tokens
  and the ring's attention terms (tests/test_remat.py pins the cp = 1 formula the same way)."""
  for rows in world.run(_activation_bytes_at_cp2, 2):
    assert [r for r in rows if r[-2] != r[-1]] == []


def test_the_estimate_divides_activations_and_logits_by_cp():
  from estimates import memory  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  c.data.seq_length = 64
  one = memory.estimate(c)
  c.distributed_strategy.context_parallel_size, c.model.fusions.ring_attention = 2, True
  two = memory.estimate(c)
  assert two['logits'] * 2 == one['logits']
  assert 0.4 < two['activations'] / one['activations'] < 0.6
  assert two['params'] == one['params']


def test_a_checkpoint_saved_at_cp2_with_zero1_resumes_at_cp1(tmp_path):
  """Checkpoints stay layout-free: optimizer shards over dp x cp read back whole on one process."""
  from checkpoint import steps as checkpoint_steps  # pylint: disable=import-outside-toplevel
  from tests import test_session  # pylint: disable=import-outside-toplevel
  world.run(test_session._run, 2, str(tmp_path / 'saved'), {'cp': 2, 'zero1': True}, 10)  # pylint: disable=protected-access
  saved = str(tmp_path / 'saved' / 'checkpoints' / 'step_00000010')
  assert checkpoint_steps.read_metadata(saved)['layout']['cp'] == 2
  (tmp_path / 'run').mkdir()
  # the resume first, in a fresh process; the uninterrupted run after it, in the same one
  world.run(world.in_turn, 1, [(test_session._resume_from, (str(tmp_path / 'run'), {}, saved)),  # pylint: disable=protected-access
                               (test_session._run, (str(tmp_path / 'straight'), {}))])  # pylint: disable=protected-access
  np.testing.assert_allclose(test_session.losses(tmp_path / 'run'), test_session.losses(tmp_path / 'straight')[10:],
                             rtol=1e-5)


def test_dry_run_shows_the_cp_layout_and_the_divided_activations():
  from estimates import summary  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config('test')
  c.data.seq_length = 64
  one = summary.dry_run(c, 1, validate.check)
  c.distributed_strategy.context_parallel_size, c.model.fusions.ring_attention = 2, True
  two = summary.dry_run(c, 2, validate.check)
  assert '2 process(es) on cpu: dp=1 x pp=1 x cp=2 (ring attention) x tp=1' in two
  assert 'cp 2: 32 tokens of each sequence per rank (activations / 2)' in two
  activations = lambda text: text.split('activations ')[1].split(' |')[0]
  assert activations(one) != activations(two)
