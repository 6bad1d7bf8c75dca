"""The two value checks every config section's owner shares, each message naming the key.

Top-level and import-free on purpose: model/, data/, parallel/, checkpoint/ and configs/ all
check their own sections (configs/validate.py gathers them), and none may import another's
package just for these.
"""
import math


def one_of(problems, key, value, allowed):
  if value not in allowed:
    problems.append(f'{key}={value!r} is unknown; valid: {", ".join(map(str, allowed))}')


def positive(problems, key, value, allow_zero=False):
  bound = '>= 0' if allow_zero else '> 0'
  if isinstance(value, float) and not math.isfinite(value):   # nan compares false with everything
    problems.append(f'{key}={value} must be a finite number {bound}')
  elif value < 0 or (value == 0 and not allow_zero):
    problems.append(f'{key}={value} must be {bound}')
