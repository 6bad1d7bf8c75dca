"""Each LR schedule against its closed form, written out here independently of optim/schedules.py."""
import math

import pytest

from configs import base
from optim import schedules

LR, MIN_LR, MAX_STEPS, WARMUP, HIDDEN = 1.0, 0.1, 100, 10, 64
# start, inside warm-up, end of warm-up, first decayed step, middle, last step, past the end
STEPS = (0, 4, WARMUP, WARMUP + 1, 55, MAX_STEPS, MAX_STEPS + 7)


def sched(**overrides):
  s = base.get_config().model.optim.sched
  s.warmup_steps, s.min_lr = WARMUP, MIN_LR
  for key, value in overrides.items():
    s[key] = value
  return s


def lr(s, step):
  return schedules.lr_at(step, s, LR, MAX_STEPS, HIDDEN)


def nemo_warmup(step):
  return LR * (step + 1) / (WARMUP + 1)


def with_warmup(decay):
  """NeMo's WarmupPolicy frame: warm-up through step W, min_lr after max_steps."""
  return lambda s: nemo_warmup(s) if s <= WARMUP else (MIN_LR if s > MAX_STEPS else decay(s))


CLOSED_FORMS = {
    'constant': lambda s: LR,
    'WarmupPolicy': with_warmup(lambda s: LR),
    'WarmupHoldPolicy': with_warmup(lambda s: LR),
    'CosineAnnealing': with_warmup(
        lambda s: MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * (s - WARMUP) / (MAX_STEPS - WARMUP))) / 2),
    'LinearAnnealingWithWarmUp': lambda s: (
        LR * s / WARMUP if s < WARMUP else LR * max(0.0, (MAX_STEPS - s) / (MAX_STEPS - WARMUP))),
    'SquareAnnealing': with_warmup(lambda s: max(MIN_LR, LR * ((MAX_STEPS - s) / (MAX_STEPS - WARMUP)) ** 2)),
    'SquareRootAnnealing': with_warmup(lambda s: max(MIN_LR, LR * math.sqrt((MAX_STEPS - s) / MAX_STEPS))),
    'WarmupAnnealing': with_warmup(lambda s: MIN_LR + (LR - MIN_LR) * (MAX_STEPS - s) / (MAX_STEPS - WARMUP)),
    'PolynomialDecayAnnealing': with_warmup(lambda s: MIN_LR + (LR - MIN_LR) * (1 - (s - WARMUP) / 90) ** 1.0),
    'StepLR': lambda s: LR * 0.1 ** (s // 100),
    'ExponentialLR': lambda s: LR * 0.1 ** s,
}


def test_every_name_has_a_closed_form_here():
  assert set(schedules.SCHEDULES) == set(CLOSED_FORMS) | {'NoamAnnealing'}


@pytest.mark.parametrize('name', sorted(CLOSED_FORMS))
def test_matches_closed_form(name):
  s = sched(name=name)
  for step in STEPS:
    assert lr(s, step) == pytest.approx(CLOSED_FORMS[name](step), rel=1e-12, abs=1e-15), (name, step)


def test_warmup_reaches_peak_at_step_w_and_starts_above_zero():
  s = sched(name='CosineAnnealing')
  assert lr(s, 0) == pytest.approx(LR / 11)
  assert lr(s, WARMUP) == LR
  assert lr(s, MAX_STEPS) == pytest.approx(MIN_LR)
  assert lr(s, 10 * MAX_STEPS) == MIN_LR


def test_cosine_with_constant_steps_is_megatron_style_and_holds_min_lr_at_the_end():
  s = sched(name='CosineAnnealing', constant_steps=20)
  decay = MAX_STEPS - WARMUP - 20
  expected = {
      0: 0.0, 4: LR * 4 / WARMUP, WARMUP: LR,
      WARMUP + 1: MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi / decay)) / 2,
      45: MIN_LR + (LR - MIN_LR) * 0.5,
      WARMUP + decay: MIN_LR, WARMUP + decay + 1: MIN_LR, MAX_STEPS: MIN_LR, MAX_STEPS + 7: MIN_LR}
  for step, want in expected.items():
    assert lr(s, step) == pytest.approx(want, abs=1e-12), step


def test_warmup_hold_holds_peak_even_past_max_steps():
  s = sched(name='WarmupHoldPolicy', hold_steps=200)
  assert [lr(s, step) for step in (0, WARMUP, 150, 209)] == pytest.approx([nemo_warmup(0), LR, LR, LR])
  assert lr(s, 210) == MIN_LR


def test_polynomial_power():
  s = sched(name='PolynomialDecayAnnealing', power=2.0)
  assert lr(s, 55) == pytest.approx(MIN_LR + (LR - MIN_LR) * (1 - 45 / 90) ** 2)


def test_step_and_exponential_use_gamma_and_step_size():
  s = sched(name='StepLR', step_size=7, gamma=0.5)
  assert [lr(s, step) for step in (0, 6, 7, 13, 14, 20)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
  s = sched(name='ExponentialLR', gamma=0.9)
  assert lr(s, 3) == pytest.approx(0.9 ** 3)


def test_noam():
  s = sched(name='NoamAnnealing', min_lr=0.0)
  closed = lambda t: LR * HIDDEN ** -0.5 * min(t ** -0.5, t * WARMUP ** -1.5)
  for step in (1, 4, WARMUP, 55, 1000):
    assert lr(s, step) == pytest.approx(closed(step)), step
  assert lr(s, 0) == lr(s, 1)
  assert lr(s, WARMUP) == pytest.approx(LR * (HIDDEN * WARMUP) ** -0.5)  # the peak
  s = sched(name='NoamAnnealing', d_model=256, min_lr=0.01)
  assert lr(s, 5) == pytest.approx(LR * 256 ** -0.5 * 5 * WARMUP ** -1.5)
  assert lr(s, 10 ** 6) == 0.01  # floored after warm-up
  s = sched(name='NoamAnnealing', warmup_steps=0, min_lr=0.0)
  assert lr(s, 16) == pytest.approx(LR * HIDDEN ** -0.5 / 4)


def test_warmup_ratio_overrides_warmup_steps_and_sched_max_steps_overrides_run():
  s = sched(name='WarmupPolicy', warmup_ratio=0.25, warmup_steps=3)
  assert lr(s, 24) == pytest.approx(LR * 25 / 26)  # W = 25
  s = sched(name='CosineAnnealing', max_steps=50, warmup_steps=0)
  assert lr(s, 25) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5)
  assert lr(s, 51) == MIN_LR


def test_unknown_name():
  with pytest.raises(ValueError, match=r"model\.optim\.sched\.name='Cosine' is unknown; valid: .*CosineAnnealing"):
    lr(sched(name='Cosine'), 0)
  problems = schedules.check_schedule(sched(name='Cosine'))
  assert len(problems) == 1 and 'NoamAnnealing' in problems[0]


def test_check_schedule():
  assert schedules.check_schedule(sched()) == []
  assert schedules.check_schedule(sched(), max_steps=MAX_STEPS) == []
  bad = sched(warmup_steps=-1, min_lr=-0.5, warmup_ratio=1.5, step_size=0, gamma=0.0, d_model=0)
  text = '\n'.join(schedules.check_schedule(bad))
  for key in ('warmup_steps', 'min_lr', 'warmup_ratio', 'step_size', 'gamma', 'd_model'):
    assert f'model.optim.sched.{key}=' in text, key
  problems = schedules.check_schedule(sched(name='SquareAnnealing', warmup_steps=100), max_steps=MAX_STEPS)
  assert len(problems) == 1 and 'never leaves warm-up' in problems[0]


def test_cosine_constant_steps_beyond_the_schedule_run_as_nemo_does_with_one_warning():
  # NxD's megatron_gpt: constant_steps 80000 with max_steps 20000. NeMo's decay_steps go negative:
  # warm-up, then min_lr for every later step.
  s = sched(name='CosineAnnealing', constant_steps=4 * MAX_STEPS)
  assert schedules.check_schedule(s, max_steps=MAX_STEPS) == []
  [warning] = schedules.schedule_warnings(s, MAX_STEPS)
  assert f'constant_steps {4 * MAX_STEPS}' in warning and f'holds min_lr={MIN_LR:g}' in warning
  assert [lr(s, step) for step in (WARMUP // 2, WARMUP)] == [LR * (WARMUP // 2) / WARMUP, LR]
  assert all(lr(s, step) == MIN_LR for step in range(WARMUP + 1, MAX_STEPS + 5))
  assert schedules.schedule_warnings(sched(name='CosineAnnealing', constant_steps=20), MAX_STEPS) == []
