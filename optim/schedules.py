"""Learning-rate schedules as pure functions of the optimizer step, following NeMo.

`lr_at(step, ...)` is the lr for optimizer step `step`, counted from 0. That is NeMo's
convention: its schedulers are torch `_LRScheduler`s, whose `last_epoch` is 0 while the first
optimizer step runs and goes up by one after each step (nemo/core/optim/lr_scheduler.py).

Notation: L = model.optim.lr, m = min_lr, M = sched.max_steps (else trainer.max_steps),
W = int(warmup_ratio * M) when warmup_ratio is set, else warmup_steps; s = step.
NeMo's warm-up and end, shared by the schedules marked [w]:
  warm-up   W > 0 and s <= W:  L (s + 1) / (W + 1)    (reaches L at s = W: it spans W + 1 steps)
  past end  s > M:             m

  constant                   L (no warm-up, no floor).
  WarmupPolicy [w]           L.
  WarmupHoldPolicy [w]       L; hold_steps more steps at L after warm-up. NeMo's class is a base
                             whose own decay is "keep L", so alone it only differs from
                             WarmupPolicy in that the hold outranks the past-end rule.
  CosineAnnealing, constant_steps = 0 [w]:
                             m + (L - m) (1 + cos(pi (s - W) / (M - W))) / 2.
  CosineAnnealing, constant_steps = C > 0 (NeMo's "Megatron" variant), D = M - W - C:
                             s <= W (W > 0): L s / W    (starts at 0, unlike [w]'s warm-up)
                             W < s <= W + D: m + (L - m) (1 + cos(pi (s - W) / D)) / 2
                             s > W + D:      m          (the C "constant" steps hold m AFTER the decay)
  LinearAnnealingWithWarmUp  NxD Training's (Hugging Face's linear schedule with warm-up):
                             s < W: L s / W;  else L max(0, (M - s) / (M - W)). Ignores min_lr.
  SquareAnnealing [w]        max(m, L ((M - s) / (M - W))^2).
  SquareRootAnnealing [w]    max(m, L sqrt((M - s) / M))   (no W shift, so lr drops after warm-up).
  WarmupAnnealing [w]        m + (L - m) (1 - (s - W) / (M - W)).
  PolynomialDecayAnnealing [w]
                             m + (L - m) (1 - (s - W) / (M - W))^power.
  NoamAnnealing              t = max(1, s), d = d_model (else hidden_size):
                             L d^-0.5 min(t^-0.5, t W^-1.5)  (W > 0),  L d^-0.5 t^-0.5  (W = 0);
                             at least m once t > W; no end at M. L is a scale: the peak is L (d W)^-0.5.
  StepLR                     L gamma^floor(s / step_size)   (torch's; no warm-up, no floor).
  ExponentialLR              L gamma^s   (torch's; NeMo steps it per epoch, flatron per optimizer step).
"""
import dataclasses
import math

SCHEDULES = (
    'constant', 'LinearAnnealingWithWarmUp', 'CosineAnnealing', 'WarmupPolicy', 'WarmupHoldPolicy',
    'SquareAnnealing', 'SquareRootAnnealing', 'NoamAnnealing', 'WarmupAnnealing', 'StepLR',
    'ExponentialLR', 'PolynomialDecayAnnealing')

# Schedules with no warm-up: they ignore warmup_steps and warmup_ratio.
_NO_WARMUP = ('constant', 'StepLR', 'ExponentialLR')

# Schedules that decay from L over the steps left after warm-up (and constant_steps).
_DECAYING = ('LinearAnnealingWithWarmUp', 'CosineAnnealing', 'SquareAnnealing', 'SquareRootAnnealing',
             'WarmupAnnealing', 'PolynomialDecayAnnealing')


@dataclasses.dataclass(frozen=True)
class _Knobs:
  base_lr: float
  min_lr: float
  max_steps: int
  warmup: int
  constant_steps: int
  hold_steps: int
  power: float
  d_model: int
  step_size: int
  gamma: float


def schedule_length(sched_cfg, max_steps):
  """M: the schedule's own max_steps when set, else the run's."""
  return int(max_steps if sched_cfg.max_steps is None else sched_cfg.max_steps)


def warmup_steps(sched_cfg, max_steps):
  """W: warmup_ratio of the schedule length when set, else warmup_steps (NeMo rounds down)."""
  total = schedule_length(sched_cfg, max_steps)
  if sched_cfg.warmup_ratio is not None:
    return int(sched_cfg.warmup_ratio * total)
  return int(sched_cfg.warmup_steps)


def _with_warmup(s, k, decay):
  """NeMo's WarmupPolicy.get_lr: its warm-up, `decay(s)` in between, min_lr past max_steps."""
  if k.warmup > 0 and s <= k.warmup:
    return k.base_lr * (s + 1) / (k.warmup + 1)
  if s > k.max_steps:
    return k.min_lr
  return decay(s)


def _fraction_decayed(s, k):
  return (s - k.warmup) / (k.max_steps - k.warmup)


def _warmup_hold(s, k):
  if k.warmup > 0 and s <= k.warmup:
    return k.base_lr * (s + 1) / (k.warmup + 1)
  if k.warmup <= s < k.warmup + k.hold_steps:  # NeMo tests the hold before the end
    return k.base_lr
  return k.min_lr if s > k.max_steps else k.base_lr


def _cosine(s, k):
  L, m, W = k.base_lr, k.min_lr, k.warmup
  if k.constant_steps <= 0:
    return _with_warmup(s, k, lambda s: m + (L - m) * 0.5 * (1 + math.cos(math.pi * _fraction_decayed(s, k))))
  # NeMo's `_linear_warmup_with_cosine_annealing`: a different warm-up, and the constant steps
  # come after the decay, at min_lr.
  decay_steps = k.max_steps - W - k.constant_steps
  if W > 0 and s <= W:
    return L * s / W
  if s > W + decay_steps:
    return m
  return m + (L - m) * 0.5 * (1 + math.cos(math.pi * (s - W) / decay_steps))


def _linear_with_warmup(s, k):
  if s < k.warmup:
    return k.base_lr * s / max(1, k.warmup)
  return k.base_lr * max(0.0, (k.max_steps - s) / max(1, k.max_steps - k.warmup))


def _noam(s, k):
  t = max(1, s)  # NeMo: steps 0 and 1 share an lr, avoiding 0^-0.5
  scale = k.base_lr * k.d_model ** -0.5
  lr = scale * (min(t ** -0.5, t * k.warmup ** -1.5) if k.warmup > 0 else t ** -0.5)
  return max(lr, k.min_lr) if t > k.warmup else lr


_RULES = {
    'constant': lambda s, k: k.base_lr,
    'WarmupPolicy': lambda s, k: _with_warmup(s, k, lambda s: k.base_lr),
    'WarmupHoldPolicy': _warmup_hold,
    'CosineAnnealing': _cosine,
    'LinearAnnealingWithWarmUp': _linear_with_warmup,
    'SquareAnnealing': lambda s, k: _with_warmup(
        s, k, lambda s: max(k.min_lr, k.base_lr * ((k.max_steps - s) / (k.max_steps - k.warmup)) ** 2)),
    'SquareRootAnnealing': lambda s, k: _with_warmup(
        s, k, lambda s: max(k.min_lr, k.base_lr * ((k.max_steps - s) / k.max_steps) ** 0.5)),
    'WarmupAnnealing': lambda s, k: _with_warmup(
        s, k, lambda s: k.min_lr + (k.base_lr - k.min_lr) * (1 - _fraction_decayed(s, k))),
    'PolynomialDecayAnnealing': lambda s, k: _with_warmup(
        s, k, lambda s: k.min_lr + (k.base_lr - k.min_lr) * (1 - _fraction_decayed(s, k)) ** k.power),
    'NoamAnnealing': _noam,
    'StepLR': lambda s, k: k.base_lr * k.gamma ** (s // k.step_size),
    'ExponentialLR': lambda s, k: k.base_lr * k.gamma ** s,
}


def _unknown_name(name):
  return f"model.optim.sched.name={name!r} is unknown; valid: {', '.join(SCHEDULES)}"


def lr_at(step: int, sched_cfg, base_lr: float, max_steps: int, hidden_size: int) -> float:
  """The lr of 0-based optimizer step `step` (NeMo's `last_epoch` during that step)."""
  if sched_cfg.name not in _RULES:
    raise ValueError(_unknown_name(sched_cfg.name))
  knobs = _Knobs(
      base_lr=float(base_lr), min_lr=float(sched_cfg.min_lr),
      max_steps=schedule_length(sched_cfg, max_steps), warmup=warmup_steps(sched_cfg, max_steps),
      constant_steps=int(sched_cfg.constant_steps), hold_steps=int(sched_cfg.hold_steps),
      power=float(sched_cfg.power),
      d_model=int(hidden_size if sched_cfg.d_model is None else sched_cfg.d_model),
      step_size=int(sched_cfg.step_size), gamma=float(sched_cfg.gamma))
  return float(_RULES[sched_cfg.name](int(step), knobs))


def _nemo_holds(sched_cfg, total):
  """CosineAnnealing whose constant_steps leave nothing to decay over: NeMo runs it (its
  decay_steps go <= 0), warming up and then holding min_lr, and so does `_cosine`."""
  return (sched_cfg.name == 'CosineAnnealing' and sched_cfg.constant_steps > 0
          and warmup_steps(sched_cfg, total) < total)


def schedule_warnings(sched_cfg, max_steps) -> list[str]:
  """Schedules that run but probably not as meant (check_schedule found no problem)."""
  total = schedule_length(sched_cfg, max_steps)
  if total <= 0 or sched_cfg.name != 'CosineAnnealing':
    return []
  warmup = warmup_steps(sched_cfg, total)
  if warmup + sched_cfg.constant_steps >= total and _nemo_holds(sched_cfg, total):
    return [f'model.optim.sched: warmup {warmup} + constant_steps {sched_cfg.constant_steps} >= the schedule\'s '
            f'{total} steps, so nothing is left to decay over: as in NeMo, the lr warms up to model.optim.lr over '
            f'{warmup} steps, then holds min_lr={sched_cfg.min_lr:g}']
  return []


def check_schedule(sched_cfg, max_steps=None) -> list[str]:
  """Problems with `model.optim.sched`, each naming the key and what would be valid.

  With `max_steps` (the run's), also reports a warm-up that fills the whole schedule, and a
  warm-up plus constant steps that leave a decaying schedule nothing to decay over.
  """
  p = 'model.optim.sched.'
  problems = []
  if sched_cfg.name not in SCHEDULES:
    problems.append(_unknown_name(sched_cfg.name))
  for key in ('warmup_steps', 'constant_steps', 'hold_steps'):
    if sched_cfg[key] < 0:
      problems.append(f'{p}{key}={sched_cfg[key]!r} is negative; must be >= 0')
  ratio = sched_cfg.warmup_ratio
  if ratio is not None and not 0.0 <= ratio < 1.0:
    problems.append(f'{p}warmup_ratio={ratio!r} must be in [0, 1) (a fraction of max_steps) or None')
  if not sched_cfg.min_lr >= 0:
    problems.append(f'{p}min_lr={sched_cfg.min_lr!r} must be >= 0')
  for key in ('max_steps', 'd_model'):
    if sched_cfg[key] is not None and sched_cfg[key] <= 0:
      problems.append(f'{p}{key}={sched_cfg[key]!r} must be > 0 or None (None: use the run\'s)')
  if sched_cfg.step_size <= 0:
    problems.append(f'{p}step_size={sched_cfg.step_size!r} must be > 0')
  if not sched_cfg.gamma > 0:
    problems.append(f'{p}gamma={sched_cfg.gamma!r} must be > 0')
  if not sched_cfg.power > 0:
    problems.append(f'{p}power={sched_cfg.power!r} must be > 0')
  if problems or (max_steps is None and sched_cfg.max_steps is None):
    return problems
  total = schedule_length(sched_cfg, max_steps)
  if total <= 0:                    # a bad trainer.max_steps: its own check reports it
    return problems
  warmup = warmup_steps(sched_cfg, total)
  used = warmup + (sched_cfg.constant_steps if sched_cfg.name == 'CosineAnnealing' else 0)
  if warmup >= total and sched_cfg.name not in _NO_WARMUP:
    # Only warmup_steps can get here: a warmup_ratio below 1 always leaves steps after it.
    length_key = 'trainer.max_steps' if sched_cfg.max_steps is None else f'{p}max_steps'
    problems.append(
        f'{p}warmup_steps={sched_cfg.warmup_steps} is not below {length_key}={total}: the lr never '
        f'leaves warm-up; lower warmup_steps or raise {length_key}')
  elif sched_cfg.name in _DECAYING and used >= total and not _nemo_holds(sched_cfg, total):
    problems.append(
        f'{p}warmup_steps/warmup_ratio (+ constant_steps) use {used} of the {total} steps; '
        f'{sched_cfg.name} needs fewer to have steps to decay over')
  return problems
