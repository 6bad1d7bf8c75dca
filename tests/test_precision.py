"""Precision recipes (numerics/precision.py): each named one, manual built from its knobs,
check()'s messages, autocast only in the autocast recipe (stochastic rounding, the module's
other half: tests/test_stochastic_rounding.py)."""
import dataclasses

import pytest
import torch

from configs import base
from numerics import precision


def _cfg(**kw):
  c = base.get_config().precision
  for k, v in kw.items():
    setattr(c, k, v)
  return c


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize('kind, expected', [
    ('fp32', (F32, F32, False, F32, F32, False, False)),
    ('bf16SR', (BF16, BF16, False, BF16, BF16, True, False)),
    ('mixed_precision', (BF16, BF16, True, F32, F32, False, False)),
    ('mixed_precisionSR', (BF16, BF16, True, F32, F32, True, False)),
    ('autocast', (F32, BF16, False, F32, F32, False, True)),
])
def test_named_recipes(kind, expected):
  r = precision.recipe(_cfg(type=kind))
  assert r.name == kind
  assert (r.param_dtype, r.compute_dtype, r.master_weights, r.grad_acc_dtype, r.reduce_dtype,
          r.stochastic_rounding, r.autocast) == expected


def test_manual_recipe_follows_its_knobs():
  r = precision.recipe(_cfg(type='manual', parameter_dtype='bf16', master_weights=True,
                            fp32_grad_acc=True, stochastic_rounding=True))
  assert (r.param_dtype, r.compute_dtype, r.master_weights) == (BF16, BF16, True)
  assert (r.grad_acc_dtype, r.reduce_dtype, r.stochastic_rounding, r.autocast) == (
      F32, F32, True, False)
  r = precision.recipe(_cfg(type='manual', parameter_dtype='bf16'))
  assert (r.grad_acc_dtype, r.master_weights, r.stochastic_rounding) == (BF16, False, False)
  fp32 = precision.recipe(_cfg(type='fp32'))
  assert precision.recipe(_cfg(type='manual')) == dataclasses.replace(fp32, name='manual')


def test_check_messages():
  assert precision.check(base.get_config().precision) == []
  [msg] = precision.check(_cfg(type='fp8'))
  assert "precision.type='fp8' is unknown" in msg and 'mixed_precisionSR' in msg and 'manual' in msg
  [msg] = precision.check(_cfg(type='manual', parameter_dtype='fp16'))
  assert "precision.parameter_dtype='fp16'" in msg and 'fp32, bf16' in msg
  [msg] = precision.check(_cfg(type='manual', master_weights=True))
  assert 'precision.master_weights=True' in msg and "parameter_dtype='bf16'" in msg
  [msg] = precision.check(_cfg(type='manual', stochastic_rounding=True))
  assert 'precision.stochastic_rounding=True' in msg
  [msg] = precision.check(_cfg(type='bf16SR', master_weights=True))
  assert "precision.master_weights=True is read only with precision.type='manual'" in msg
  with pytest.raises(ValueError, match='precision.type'):
    precision.recipe(_cfg(type='bf16'))


def test_compute_context_autocasts_only_the_autocast_recipe():
  a, b = torch.randn(4, 4), torch.randn(4, 4)
  with precision.compute_context(precision.recipe(_cfg(type='autocast')), 'cpu'):
    assert (a @ b).dtype == torch.bfloat16
  with precision.compute_context(precision.recipe(_cfg(type='fp32')), 'cpu'):
    assert (a @ b).dtype == torch.float32
