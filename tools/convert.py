"""Hugging Face Llama directory <-> flatron checkpoint, both ways, bit-exact.

    python tools/convert.py hf-to-flatron --src=/models/llama --dst=runs/ft/checkpoints
    python tools/convert.py flatron-to-hf --src=runs/ft/checkpoints/step_00001000 --dst=/models/out

A converted checkpoint is step 0 with parameters only; train from it with
`--config.exp_manager.init_from=<dst>/step_00000000` (or point init_from at the HF directory
directly: no conversion needed). Layout-free: any TP/PP/DP degree loads it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_dict  # pylint: disable=wrong-import-position
import torch  # pylint: disable=wrong-import-position

from checkpoint import manager as managers, state as states, store  # pylint: disable=wrong-import-position
from configs import base  # pylint: disable=wrong-import-position
from model import hf, transformer  # pylint: disable=wrong-import-position
from optim import update  # pylint: disable=wrong-import-position
from parallel import mesh as meshes  # pylint: disable=wrong-import-position

_SRC = flags.DEFINE_string('src', None, 'HF directory or flatron checkpoint step directory.')
_DST = flags.DEFINE_string('dst', None, 'Checkpoint root (hf-to-flatron) or HF directory.')


def hf_to_flatron(src, dst):
  """Write the HF model as step 0 of the checkpoint root `dst`; returns the step path."""
  config = base.get_config()             # the saved config: defaults around the HF model
  config.model, params = hf.load_hf(src, config.model)
  updater = update.Updater(params, config, meshes.Mesh())
  layout = states.StateLayout(config, meshes.Mesh(), updater, state_keys=())
  manager = managers.CheckpointManager(dst)
  manager.save(0, layout.local_tensors(), layout.layouts(),
               states.step_metadata(config, meshes.Mesh(), 0, (), 0, converted_from=src))
  manager.wait()
  return manager.step_path(0)


def flatron_to_hf(src, dst):
  """Write the parameters of checkpoint step `src` as a Hugging Face Llama directory."""
  meta = managers.read_metadata(src)
  config = config_dict.ConfigDict(meta['config'])
  model = config.model
  specs = transformer.param_specs(model)
  requests = {n: tuple(slice(0, k) for k in states.logical_shape(n, spec, model))
              for n, spec in specs.items()}
  arrays = store.load_arrays(src, requests)
  params = {}
  for name, spec in specs.items():
    value = arrays[name]
    if value.shape != spec.shape:                       # re-pad the vocabulary rows
      padded = torch.zeros(spec.shape, dtype=value.dtype)
      padded[:value.shape[0]] = value
      value = padded
    params[name] = value
  hf.save_hf(dst, model, params)


def main(argv):
  if len(argv) != 2 or argv[1] not in ('hf-to-flatron', 'flatron-to-hf') or not (_SRC.value and _DST.value):
    raise app.UsageError('usage: convert.py hf-to-flatron|flatron-to-hf --src=... --dst=...')
  if argv[1] == 'hf-to-flatron':
    print(hf_to_flatron(_SRC.value, _DST.value))
  else:
    flatron_to_hf(_SRC.value, _DST.value)
    print(_DST.value)


if __name__ == '__main__':
  app.run(main)
