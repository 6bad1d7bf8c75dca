"""Qwen3, Qwen3-MoE, OLMo 2, SmolLM3, Phi-3, gpt-oss, DeepSeek-V3 and Llama 4, each with every feature of the family on
(tests/parity.py apply_family), train like one device at every layout (fp32, 10 steps, active
clipping, the layout-parity bounds of parity.compare) and compiled like eager, a graph for each
kind of layer; what a family cannot run with is refused by name."""
import contextlib

import pytest
import torch

from configs import validate
from model import hf_export, moe, transformer
from parallel import compiled
from tests import parity, world

FAMILIES = ('qwen3', 'qwen3_moe', 'olmo2', 'smollm3', 'phi3', 'gpt_oss', 'deepseek_v3', 'llama4')
MOE = ('qwen3_moe', 'gpt_oss', 'deepseek_v3', 'llama4')
# interleaving needs layers divisible by pp x vp = 4; Qwen3-MoE's 8 put MoE layers on both pp2
# stages and a dense-only chunk beside MoE ones at vp2 (parity.apply_family)
LAYERS = {'qwen3_moe': 8}
# parity's lr 1e-2 moves these tiny models' weights by a third of their size a step: grad-norm
# spikes (to 27 in Qwen3-MoE's 9th step) amplify round-off 1e3x past the bounds; 1e-3 keeps the
# norms within 1.1-3.1 and still moves weights by ~1e-2 in 10 steps, 1e3x the parameter bound
LR = 1e-3
# DeepSeek-V3's bias moves: large enough that every step changes which experts some tokens choose
BALANCE_RATE = 0.05


def _rows(family):
  """name: (world size, parity_config kwargs) of the family's layouts."""
  base = {'family': family, 'layers': LAYERS.get(family, 4), 'lr': LR}
  if family == 'deepseek_v3':        # the correction biases move by the global expert loads each step
    base['balance_rate'] = BALANCE_RATE
  # TP and CP rows take 2 micro batches of 4 (the reference 4 of 2): their collectives per
  # micro batch are most of the file's time on 2 cores; both still accumulate
  # OLMo 2's single KV head is held by both tp ranks: its k-norm's sum over TP is halved
  tp = {'tp': 2, 'sp': True, 'kv_replicator': 2 if family == 'olmo2' else 1, 'micro': 4}
  # cp2: the ring with gpt-oss's sinks and windows, latent attention's narrower values, Llama 4's
  # chunks and temperature; the MoE losses' counts summed over the slices of each row
  rows = {'tp2_sp': (2, tp), 'pp2': (2, {'pp': 2}), 'pp2_vp2': (2, {'pp': 2, 'vp': 2}),
          'dp2_zero1': (2, {'zero1': True}), 'cp2': (2, {'cp': 2, 'micro': 4})}
  if family in MOE:
    rows['ep2'] = 2, {'ep': 2}
    rows['ep2_tp2_sp'] = 4, {'ep': 2, 'tp': 2, 'sp': True}   # experts over EP (dp 2), each split over TP
  if family == 'deepseek_v3':        # experts over EP (dp 2) fed by both slices of each row: their gradients summed over cp
    rows['ep2_cp2'] = 4, {'ep': 2, 'cp': 2, 'micro': 4}
  if family in ('gpt_oss', 'deepseek_v3', 'llama4'):   # the traced path's fixed-size expert buffers, exchanged over EP
    rows['ep2_fixed_buffers'] = 2, {'ep': 2, 'fixed_buffers': True}
  return {f'{family}_{name}': (size, dict(base, **kwargs)) for name, (size, kwargs) in rows.items()}


LAYOUTS = {name: row for family in FAMILIES for name, row in _rows(family).items()}
# model.compile (TP and CP refuse it) at pp2: each stage traces the kinds of layer it holds
COMPILED = {f'{family}_pp2_compiled': (2, {'family': family, 'layers': LAYERS.get(family, 4), 'lr': LR, 'pp': 2,
                                           'compile_blocks': True}) for family in FAMILIES}


@contextlib.contextmanager
def _one_thread():
  """The single-device references train in this process: with one thread, as the spawned ranks
  do (two OpenMP threads on a shared 2-core machine spin on each other: several times slower)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(threads)


def train_rows_on_rank(workdirs, layouts):
  """parity.train_on_rank of each layout in turn; a compiled one from a fresh dynamo cache, with
  the number of graphs of the block traced on this rank (None for the others)."""
  out = []
  for workdir, layout in zip(workdirs, layouts):
    if layout.get('compile_blocks'):
      torch._dynamo.reset()  # pylint: disable=protected-access
    result = parity.train_on_rank(workdir, layout)
    graphs = None
    if layout.get('compile_blocks'):
      graphs = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(compiled._block.__code__))  # pylint: disable=protected-access
    out.append((result, graphs))
  return out


def layer_kinds(model_cfg, layers):
  """What the block gets that differs between `layers`: RoPE or none, the mask, MoE or dense."""
  nope, types = set(model_cfg.nope_layers), transformer.layer_types(model_cfg)
  return {(i in nope, types[i], moe.is_moe_layer(model_cfg, i)) for i in layers}


def check_graphs(name, layout, graphs_per_rank):
  """Each pp stage traced its layers' kinds (SmolLM3's NoPE layers, Qwen3-MoE's dense and MoE
  ones, sliding and full masks): a block frozen at layer 0's branch would have traced one and run
  every layer as layer 0, which compare() would see."""
  model_cfg = parity.parity_config(**layout).model
  per_stage = model_cfg.num_layers // layout['pp']
  for stage, graphs in enumerate(graphs_per_rank):
    kinds = len(layer_kinds(model_cfg, range(stage * per_stage, (stage + 1) * per_stage)))
    # MoE layers too: the router losses' sums are running tensors, not a list the block would
    # be guarded on (and recompiled for) as it grows layer by layer
    assert graphs == kinds, (name, stage, graphs, kinds)


def check_rows(rows, tmp_path, tmp_path_factory):
  """parity.check_layouts for rows of one world size, compiled ones too (their graphs checked)."""
  names = list(rows)
  world_size = rows[names[0]][0]
  per_rank = world.run(train_rows_on_rank, world_size, [str(tmp_path / n) for n in names],
                       [rows[n][1] for n in names], timeout=240 * len(names))
  with _one_thread():
    for i, name in enumerate(names):
      parity.compare(name, rows[name][1], [rank[i][0] for rank in per_rank], tmp_path_factory)
      if rows[name][1].get('compile_blocks'):
        check_graphs(name, rows[name][1], [rank[i][1] for rank in per_rank])


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_family_layouts_train_like_one_device(world_size, tmp_path, tmp_path_factory):
  """Every family's layouts of one world size, one after another in one spawned world."""
  check_rows(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


@pytest.mark.timeout(900)    # eight families' inductor compiles from a cold cache: ~3 minutes on two idle cores
def test_compiled_families_train_like_eager(tmp_path, tmp_path_factory):
  """Each family compiled equals its eager single-device run at the layout bounds; a world of its
  own: from a cold inductor cache its compiles take as long as every layout above."""
  check_rows(COMPILED, tmp_path, tmp_path_factory)


def test_compiled_stages_hold_more_than_one_kind_of_layer():
  """check_graphs above sees each pp2 stage of SmolLM3 (RoPE + full, NoPE + sliding), Qwen3-MoE
  (dense, MoE) and Qwen3's first (full, sliding) trace more than one graph of the block."""
  kinds = {f: [len(layer_kinds(c, range(s * c.num_layers // 2, (s + 1) * c.num_layers // 2))) for s in (0, 1)]
           for f in FAMILIES for c in [parity.parity_config(family=f, layers=LAYERS.get(f, 4)).model]}
  assert kinds == {'qwen3': [2, 1], 'qwen3_moe': [2, 2], 'olmo2': [1, 1], 'smollm3': [2, 2], 'phi3': [1, 1],
                   'gpt_oss': [2, 2], 'deepseek_v3': [2, 1], 'llama4': [2, 2]}, kinds


def _problems(world_size, **layout):
  return '\n'.join(validate.check(parity.parity_config(**layout), world_size))


def test_what_a_family_cannot_run_with_is_refused_by_name():
  # MoE under cp with a preference objective: its loss is per whole row, the aux losses per slice
  assert "model.objective='dpo' with MoE and distributed_strategy.context_parallel_size=2" in \
      _problems(2, family='deepseek_v3', cp=2, objective='dpo')
  # Phi-3's longrope (Phi-3-128k, Phi-4-mini) under cp: its factors depend on the longest
  # position, which a slice does not see; the cp2 row above has none
  c = parity.parity_config(family='phi3', layers=4, cp=2)
  assert validate.check(c, 2) == []
  c.model.rope_scaling.update(type='longrope', short_factor=(1.0, 1.0), long_factor=(2.0, 2.0),
                              original_max_position_embeddings=8)
  assert "model.rope_scaling.type='longrope' with distributed_strategy.context_parallel_size=2" in \
      '\n'.join(validate.check(c, 2))
  # OLMo 2's one KV head at tp2 without copies of it
  assert 'set distributed_strategy.kv_replicator=2' in _problems(2, family='olmo2', tp=2)
  # model.compile with TP or CP (each family's block the same way)
  for family in FAMILIES:
    layers = LAYERS.get(family, 4)
    assert 'model.compile=True with distributed_strategy.tensor_model_parallel_size=2' in \
        _problems(2, family=family, layers=layers, tp=2, compile_blocks=True)
  assert 'model.compile=True with distributed_strategy.context_parallel_size=2' in \
      _problems(2, family='smollm3', layers=4, cp=2, compile_blocks=True)


@pytest.mark.parametrize('family', FAMILIES)
def test_each_family_config_is_what_its_hf_family_expresses(family):
  """The model sections trained above are real families: each exports as its HF model_type."""
  c = parity.parity_config(family=family, layers=LAYERS.get(family, 4))
  assert hf_export.config_to_hf(c.model)['model_type'] == {'llama4': 'llama4_text'}.get(family, family)
