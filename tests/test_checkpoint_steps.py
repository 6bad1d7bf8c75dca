"""checkpoint/steps.py: step directory names from a filename template (formatted, read back,
templates that cannot be read back refused), and which steps save_top_k keeps by monitor and
mode."""
import pytest

from checkpoint import steps


def test_the_default_name_is_step_and_eight_digits():
  names = steps.Names()
  assert names.format(100, 800) == 'step_00000100'
  assert names.parse('step_00000100') == 100
  assert names.parse('step_00000100.rejected') is None and names.parse('index_cache') is None


def test_a_template_formats_and_reads_back_and_default_names_are_still_found():
  names = steps.Names('megatron_llama--{step}-{consumed_samples}')
  assert names.format(100, 800) == 'megatron_llama--100-800'
  assert names.parse('megatron_llama--100-800') == 100
  assert names.parse('step_00000007') == 7            # saved before the template was set
  assert names.parse('megatron_llama--100-800.rejected') is None
  assert names.parse('megatron_llama--x-800') is None and names.parse('megatronXllama--1-8') is None
  padded = steps.Names('{consumed_samples}.ckpt-{step:06d}')
  assert padded.format(3, 24) == '24.ckpt-000003' and padded.parse('24.ckpt-000003') == 3


@pytest.mark.parametrize('template,message', [
    ('megatron_llama--{consumed_samples}', 'must hold {step} exactly once'),
    ('{step}-{step}', 'must hold {step} exactly once'),
    ('{step}-{val_loss}', "has field(s) ['val_loss']; only {step} and {consumed_samples}"),
    ('{step}{consumed_samples}', 'put a separator between {step} and {consumed_samples}'),
    ('run/{step}', 'holds a "/"'),
    ('{step:.2f}', 'may only carry an integer width such as {step:08d}'),
    ('{step!r}', 'may only carry an integer width'),
    ('{step', 'is not a format string'),
])
def test_templates_that_cannot_be_read_back_are_named_with_the_fix(template, message):
  problems = steps.template_problems(template)
  assert any(message in p for p in problems), problems
  assert all(p.startswith(f'exp_manager.checkpoint_callback_params.filename={template!r}') for p in problems)
  with pytest.raises(ValueError):
    steps.Names(template)


def test_by_step_and_max_the_newest_k_are_kept():
  values = {s: s for s in (1, 2, 3, 4)}
  assert steps.to_keep(values, 2, 'max') == {3, 4}
  assert steps.to_keep(values, -1, 'max') == {1, 2, 3, 4} == steps.to_keep(values, None)
  assert steps.to_keep(values, 2, 'min', pinned={4, 9}) == {1, 2, 4}


def test_by_a_metric_the_best_are_kept_ties_to_the_newer_and_steps_without_a_value_last():
  values = {1: 2.0, 2: 1.5, 3: None, 4: 1.5, 5: float('nan'), 6: 3.0}
  assert steps.to_keep(values, 1, 'min') == {4}
  assert steps.to_keep(values, 2, 'min') == {2, 4}
  assert steps.to_keep(values, 2, 'max') == {1, 6}
  assert steps.to_keep(values, 5, 'min') == {1, 2, 4, 5, 6}      # of the two without a value, the newer
  assert steps.to_keep(values, 1, 'min', pinned={3}) == {3, 4}
