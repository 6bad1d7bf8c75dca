"""Activation bytes kept for backward per layer and rank: measured with saved-tensor hooks
against estimates/activations.py's formula, for every recompute mode on one rank, TP2 and TP2+SP,
on both attention paths, at the config's micro batch and sequence length.

    python -m tools.activation_memory --config=configs/llama_tiny.py
    python -m tools.activation_memory --config=configs/llama7b.py:smoke --dtype=bf16
    python -m tools.activation_memory --config=configs/llama7b.py --dtype=bf16 --nomeasure

TP2 runs on two spawned CPU processes (gloo). Dropout counts when the config has it.
--nomeasure prints the formula alone (full-size models take minutes to measure on CPU).
"""
import copy
import os
import pickle
import socket
import tempfile

from absl import app, flags
from ml_collections import config_flags
import torch
import torch.multiprocessing as mp

from estimates import activations
from model import param_table, transformer
from parallel import mesh as meshes
import tools

FLAGS = flags.FLAGS

MODES = {'none': (None, ()), 'selective (attention)': ('selective', ('attention',)),
         'selective (attention, mlp)': ('selective', ('attention', 'mlp')), 'full': ('full', ())}
PATHS = {'fused (SDPA)': True, 'explicit softmax': False}
LAYOUTS = {'tp1': (1, False), 'tp2': (2, False), 'tp2+sp': (2, True)}
DTYPES = {'fp32': (torch.float32, 4), 'bf16': (torch.bfloat16, 2)}


def variant(config, flash, mode, tp, sp):
  c = copy.deepcopy(config)
  m, d = c.model, c.distributed_strategy
  m.fusions.flash_attention = flash
  m.activations_checkpoint_granularity, m.activations_checkpoint_recompute = MODES[mode]
  d.tensor_model_parallel_size, d.sequence_parallel, d.pipeline_model_parallel_size = tp, sp, 1
  d.kv_replicator = max(1, tp // param_table.kv_heads(m))
  return c


def fits(config, tp, sp):
  m = config.model
  g = param_table.kv_heads(m)
  heads_split = m.num_attention_heads % tp == 0 and (g % tp == 0 or tp % g == 0)
  return heads_split and m.ffn_hidden_size % tp == 0 and (not sp or config.data.seq_length % tp == 0)


def cells(config, dtype_name, tp=None, mesh=None, measure=True):
  """{(path, mode, layout): (measured or None, formula)} for the layouts with TP degree `tp`
  (all layouts when None)."""
  dtype, width = DTYPES[dtype_name]
  out = {}
  for layout, (layout_tp, sp) in LAYOUTS.items():
    if tp not in (None, layout_tp) or not fits(config, layout_tp, sp):
      continue
    for path, flash in PATHS.items():
      for mode in MODES:
        c = variant(config, flash, mode, layout_tp, sp)
        measured = activations.measured_bytes_per_layer(c, mesh, dtype) if measure else None
        out[path, mode, layout] = (measured, activations.activation_bytes_per_layer(c, width, layout_tp))
  return out


def _on_rank(rank, port, out, config, dtype_name):
  """One of two TP ranks, in torchrun's environment; rank 0 pickles its cells to `out`."""
  os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2', LOCAL_WORLD_SIZE='2',
                    MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
  torch.set_num_threads(1)                       # the two ranks share the machine's cores
  try:
    table = cells(config, dtype_name, 2, meshes.init(variant(config, True, 'none', 2, False)))
  finally:
    meshes.shutdown()
  if rank == 0:                                  # ranks are symmetric
    with open(out, 'wb') as f:
      pickle.dump(table, f)


def _tp2_cells(config, dtype_name):
  """cells() at TP 2, measured on two spawned CPU processes (gloo)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'cells.pkl')
    mp.spawn(_on_rank, (port, out, config, dtype_name), nprocs=2)   # raises if a rank fails
    with open(out, 'rb') as f:
      return pickle.load(f)


def measure(config, dtype_name='fp32'):
  table = cells(config, dtype_name, 1)
  if fits(config, 2, False):
    table.update(_tp2_cells(config, dtype_name))
  return table


def _measured(table):
  return any(measured is not None for measured, _ in table.values())


def render(config, table, dtype_name):
  m, a = config.model, config.data
  dropout = max(m.hidden_dropout, m.attention_dropout, m.ffn_dropout)
  lines = [f'{config.name}: s={a.seq_length} b={a.micro_batch_size} h={m.hidden_size} '
           f'f={m.ffn_hidden_size} a={m.num_attention_heads} g={param_table.kv_heads(m)} '
           f'd={transformer.head_dim(m)} {m.activation} {m.normalization} {dtype_name} dropout={dropout}',
           'bytes kept for backward per layer and rank: ' + (
               'measured, = when the formula agrees' if _measured(table) else 'formula only')]
  if m.attention_dropout > 0:
    lines.append('attention dropout > 0: both paths take the explicit softmax')
  for path in PATHS:
    lines.append(f'\n{path:28s}' + ''.join(f'{layout:>26s}' for layout in LAYOUTS))
    for mode in MODES:
      row = f'{mode:28s}'
      for layout in LAYOUTS:
        measured, formula = table.get((path, mode, layout), (None, None))
        if formula is None:
          cell = 'n/a'
        elif measured is None:
          cell = f'{formula:,}'
        else:
          cell = f'{measured:,} ' + ('=' if measured == formula else f'!= {formula:,}')
        row += f'{cell:>26s}'
      lines.append(row)
  if _measured(table):
    exact = all(measured == formula for measured, formula in table.values())
    lines.append('\nall measured == formula' if exact else '\nMISMATCH: formula and measurement differ')
  return '\n'.join(lines)


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).')
  flags.mark_flag_as_required('config')
  flags.DEFINE_enum('dtype', 'fp32', ['fp32', 'bf16'], 'Parameter (and activation) dtype.')
  flags.DEFINE_bool('measure', True, 'Measure; with --nomeasure print the formula only.')


def main(argv):
  tools.no_arguments(argv)
  config = FLAGS.config
  table = measure(config, FLAGS.dtype) if FLAGS.measure else cells(config, FLAGS.dtype, measure=False)
  print(render(config, table, FLAGS.dtype))


if __name__ == '__main__':
  define_flags()
  app.run(main)
