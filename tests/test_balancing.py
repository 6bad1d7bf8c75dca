"""optim/balancing.py: DeepSeek-V3's auxiliary-loss-free balancing. The update rule exactly, a
skipped step moving nothing, the loads of a run moving toward balance, the biases resumed
bitwise (ZeRO-1 and ZeRO-3 over two ranks, experts over two), and the settings it refuses.
Every layout moving them like one device: tests/test_family_layouts.py's DeepSeek-V3 rows."""
import json
import os

import numpy as np
import pytest
import torch

from checkpoint import manager as managers
from configs import validate
from model import moe
from optim import balancing
from parallel import mesh as meshes
from tests import parity, world
from tests.test_session import _run, losses

RATE = 0.05
DEEPSEEK = {'family': 'deepseek_v3', 'layers': 4, 'balance_rate': RATE}


def test_each_bias_moves_by_the_rate_toward_the_mean_load():
  c = parity.parity_config(**DEEPSEEK)
  mesh = meshes.init(c, 'cpu')
  name = 'layers.1.mlp' + balancing.BIAS
  params = {name: torch.tensor([0.5, 0.0, -0.5, 0.25, 0.0, 0.0, 0.0, 0.0])}
  loads = {'layers.1.mlp': torch.tensor([9., 2., 4., 0., 4., 4., 4., 5.])}    # mean 4
  balancing.update(params, loads, c, mesh)
  torch.testing.assert_close(params[name], torch.tensor([0.45, 0.05, -0.5, 0.3, 0.0, 0.0, 0.0, -0.05]))
  before = params[name].clone()
  balancing.update(params, loads, c, mesh, updated=False)                    # a skipped step
  balancing.update(params, loads, c, mesh, updated=torch.tensor(False))     # ... decided on the device
  assert torch.equal(params[name], before)


def _load_imbalance(workdir, last):
  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl')) if '"loss"' in line]
  return float(np.mean([r['moe_load_max_over_mean'] for r in rows[-last:]]))


def test_a_run_moves_the_load_toward_balance(tmp_path):
  """The same 20 steps with the biases fixed at 0 and moving: the busiest expert's share of a
  sequence's tokens over its last 10 steps falls, and the biases have moved."""
  import train  # pylint: disable=import-outside-toplevel
  out = {}
  for rate in (0.0, RATE):
    c = parity.parity_config(**dict(DEEPSEEK, balance_rate=rate), steps=20)
    _, params = train.run(c, str(tmp_path / str(rate)))
    out[rate] = _load_imbalance(tmp_path / str(rate), 10), params
  print(f'load max / mean over the last 10 steps: fixed {out[0.0][0]:.3f}, moving {out[RATE][0]:.3f}')
  assert out[RATE][0] < out[0.0][0]
  biases = [p for n, p in out[RATE][1].items() if n.endswith(balancing.BIAS)]
  assert len(biases) == len(moe.moe_layers(c.model)) and all(b.abs().max() > 0 for b in biases)
  assert all(p.abs().max() == 0 for n, p in out[0.0][1].items() if n.endswith(balancing.BIAS))


@pytest.mark.parametrize('layout', [{'zero1': True, 'ep': 2}, {'zero1': True, 'zero_stage': 3}])
def test_the_biases_resume_bitwise(tmp_path, layout):
  layout = dict(DEEPSEEK, **layout)
  first = world.run(world.in_turn, 2, [(_run, (str(tmp_path / 'straight'), layout, 0)),
                                       (_run, (str(tmp_path / 'resumed'), layout, 10))])
  assert managers.CheckpointManager(str(tmp_path / 'resumed' / 'checkpoints')).committed_steps() == [10]
  resumed = world.run(_run, 2, str(tmp_path / 'resumed'), layout, 0)
  assert losses(tmp_path / 'resumed') == losses(tmp_path / 'straight')
  model = parity.parity_config(**layout).model
  a, b = parity.assemble([r[0] for r in first], model), parity.assemble(resumed, model)
  assert any(n.endswith(balancing.BIAS) and np.abs(a[n]).max() > 0 for n in a)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_what_it_cannot_run_with_is_refused_by_name():
  c = parity.parity_config(**DEEPSEEK)
  assert validate.check(c, 1) == []
  c.model.moe.load_balance_bias = False
  assert 'model.moe.load_balance_rate=0.05 moves the correction bias' in '\n'.join(validate.check(c, 1))
  c = parity.parity_config(**DEEPSEEK, compile_blocks=True)
  assert 'model.moe.load_balance_rate > 0 with model.compile=True' in '\n'.join(validate.check(c, 1))
  c = parity.parity_config(**DEEPSEEK, lora=4)
  assert 'model.moe.load_balance_rate > 0 with LoRA' in '\n'.join(validate.check(c, 1))
