"""parallel/layer_stats.py: per-layer and per-group gradient and parameter norms and MoE loads on
logged steps add up to the global norms and equal one device's at tp2 + SP, pp2, dp2 + ZeRO-1,
ZeRO-3 and ep2 (fp32, the parity models)."""
import json
import math
import os

import numpy as np
import pytest

from configs import validate
from parallel import layer_stats
from tests import parity, world

STEPS = 4
LAYOUTS = {'tp2_sp': {'tp': 2, 'sp': True}, 'pp2': {'pp': 2}, 'dp2_zero1': {'zero1': True},
           'dp2_zero3': {'zero1': True, 'zero_stage': 3}, 'ep2': {'moe': 4, 'ep': 2}, 'ep2_zero1': {'moe': 4, 'ep': 2, 'zero1': True}}


def _stats(workdir, layout):
  """Train `layout` with the statistics on; rank 0's logged training records."""
  import train  # pylint: disable=import-outside-toplevel
  c = parity.parity_config(steps=STEPS, **layout)
  c.exp_manager.log_layer_stats = True
  train.run(c, workdir)
  if os.environ.get('RANK', '0') != '0':
    return None
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [r for r in map(json.loads, f) if 'loss' in r]


def _on_ranks(workdir, names):
  return [_stats(os.path.join(workdir, n), LAYOUTS[n]) for n in names]


def test_groups_add_up_to_the_global_norms(tmp_path):
  for record in _stats(str(tmp_path / 'moe'), {'moe': 4}):
    for kind in ('grad_norm', 'param_norm'):
      groups = [record[f'{kind}/{g}'] for g in layer_stats.GROUPS if f'{kind}/{g}' in record]
      assert math.sqrt(sum(v * v for v in groups)) == pytest.approx(record[kind], rel=1e-5), kind
    assert {k for k in record if k.startswith('grad_norm/')} == \
        {'grad_norm/layers.0', 'grad_norm/layers.1', 'grad_norm/attention', 'grad_norm/experts', 'grad_norm/router',
         'grad_norm/norms', 'grad_norm/embedding', 'grad_norm/head'}
    assert record['moe_load/layers.0'] >= 1.0 and record['moe_load/layers.1'] >= 1.0


def test_every_layout_gives_one_devices_statistics(tmp_path):
  names = sorted(LAYOUTS)
  got = world.run(_on_ranks, 2, str(tmp_path), names, timeout=240 * len(names))[0]
  for name, records in zip(names, got):
    reference = _stats(str(tmp_path / f'{name}_ref'), {k: v for k, v in LAYOUTS[name].items() if k in parity.MODEL_KEYS})
    keys = sorted(k for k in reference[0] if '/' in k) + ['grad_norm', 'param_norm']
    assert sorted(k for k in records[0] if '/' in k) == keys[:-2], name
    ours = np.array([[r[k] for k in keys] for r in records])
    want = np.array([[r[k] for k in keys] for r in reference])
    print(f'{name}: {len(keys)} statistics x {STEPS} steps, worst relative error {np.max(np.abs(ours / want - 1)):.2e}')
    np.testing.assert_allclose(ours, want, rtol=1e-5, err_msg=name)


def test_moe_statistics_with_compiled_blocks_are_refused():
  c = parity.parity_config(moe=4, compile_blocks=True)
  c.exp_manager.log_layer_stats = True
  assert 'exp_manager.log_layer_stats=True with MoE and model.compile=True' in '\n'.join(validate.check(c))


def test_names_fall_in_their_groups():
  assert [layer_stats.group_of(n) for n in (
      'embed_tokens.weight', 'lm_head.weight', 'norm.weight', 'layers.3.input_layernorm.weight',
      'layers.3.self_attn.q_proj.lora_A.weight', 'layers.3.self_attn.sinks', 'layers.3.mlp.gate.weight',
      'layers.3.mlp.gate.e_score_correction_bias', 'layers.3.mlp.gate_proj.weight', 'layers.3.mlp.experts.down_proj',
      'layers.3.mlp.shared_expert_gate.weight')] == [
          'embedding', 'head', 'norms', 'norms', 'attention', 'attention', 'router', 'router', 'mlp', 'experts', 'mlp']
