"""bf16SR's update in one pass: AdamW on bf16 rows and moments, rounded back stochastically.

bf16SR keeps parameters and Adam moments in bf16 (NxD Training's recipe). Done with stock ops,
an update widens rows and moments to fp32 copies, runs torch's AdamW over them (a pass per op)
and rounds all three back (several more passes each, plus a hash of every element's index):
about as long as forward and backward together. `adamw_step` does it per tensor in one fused
loop -- read bf16 row, gradient (bf16, scaled by the clip coefficient in the loop) and bf16
moments, write the three rounded -- compiled by torch.compile (inductor: C++ on CPU, its bit
casts kept in vector registers by optim/inductor_bitcast.py) and 6x cheaper than the eager
pipeline on the 32M bench.

The math is torch.optim.AdamW's (Adam's) single-tensor step, op for op in fp32, and the
rounding is numerics/stochastic_rounding.py's: each output element i gets stochastic_round with
noise_at(global index of i, key_seed(key)), keyed (seed, 'sr', step, name[, moment]) as in
optim/update.py's unfused path. Every kernel here is also a plain function: where compiling is
not possible (a device type not in COMPILED_DEVICES, XLA, no C++ compiler) the same function
runs eagerly, and compiled and eager agree bit for bit (integer ops and IEEE fp32 ops without
contraction; inductor passes -ffp-contract=off to its C++ compiler; the one sqrt goes through
fp64 in eager mode, `_sqrt`). On CUDA, triton contracts a * b + c into one fma and divides
approximately unless told otherwise: the kernels compile there under inductor's eager-numerics
settings (`_compile_settings`). Before the first use on a device type other than the CPU, each
kernel runs compiled and eagerly on a probe of 4M awkward values, and runs compiled only if
every bit agrees (`_checked`); else eagerly, with a warning.
"""
import functools
import logging

import torch

import host_values
from numerics import precision, stochastic_rounding
from optim import graphed, inductor_bitcast
from optim.sr_kernels import _adamw_fp32_kernel, _adamw_kernel, _adamw_master_kernel, _round_kernel
from parallel import grads

# Device types the kernels are compiled for (elsewhere, XLA, the eager pipeline runs).
COMPILED_DEVICES = precision.FUSED_SR_DEVICES
FP32_DEVICES = precision.FUSED_FP32_DEVICES     # ... and for fp32 rows

_failed = set()        # (kernel, device type) pairs that run eagerly in this process
_checks = {}           # (kernel, device type) -> whether compiled had eager's bits on the probe


# Graphs one kernel may need in a process: its tensors' ranks (1-3 after coalescing) x gradient
# dtype x Adam's L2 or not x int32 / int64 indices; dynamo's default limit (8) would send the
# rest eager (the same bits, slower).
_GRAPHS = 24


@functools.lru_cache(maxsize=None)
def _compiled(kernel):
  torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _GRAPHS)  # pylint: disable=protected-access
  return torch.compile(kernel, dynamic=True, fullgraph=True)


def _compile_settings(device):
  """The inductor settings the kernels compile under: on the CPU, bit casts in vector registers;
  elsewhere (triton) eager's numerics -- no fma contraction (emulate_precision_casts) and
  IEEE division (eager_numerics.division_rounding, in torch releases that have it)."""
  if device.type == 'cpu':
    return inductor_bitcast.vector_bitcasts()
  from torch._inductor import config  # pylint: disable=import-outside-toplevel
  exact = {'emulate_precision_casts': True}
  if hasattr(getattr(config, 'eager_numerics', None), 'division_rounding'):
    exact['eager_numerics.division_rounding'] = True
  return config.patch(exact)


def _probe(kernel, device):
  """Arguments for `kernel` on `device`: 4M fp32 values over 80 binary orders of magnitude
  and the non-finite, overflowing and subnormal ones, fixed (a seeded CPU generator)."""
  g, n = torch.Generator().manual_seed(0), 1 << 22
  x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
  x[:6] = torch.tensor([float('nan'), float('inf'), -float('inf'), 3.39e38, -3.4e38, 1e-40])
  _, layout = _layout((slice(0, n),), (n,), device)
  if kernel is _round_kernel:
    return [x.to(device), layout, _seed(('probe',), device)]
  gradient = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 4, (n,), generator=g).float())
  scalars, l2 = _scalars({'lr': 3e-4, 'betas': (0.9, 0.95), 'eps': 1e-8, 'weight_decay': 0.1,
                          'decoupled_weight_decay': True}, 3.0)
  scalars = torch.tensor(scalars, dtype=torch.float32, device=device)
  dtype = torch.bfloat16 if kernel is _adamw_kernel else torch.float32
  cast = lambda t: t.to(device, dtype)
  args = [cast(x * 1e-6), cast(gradient), torch.tensor(0.73, device=device), cast(gradient.roll(1) * 0.1),
          cast(gradient.roll(2).square()), scalars]
  if kernel is _adamw_fp32_kernel:
    return args + [l2]
  if kernel is _adamw_master_kernel:
    return args + [l2, torch.empty(n, dtype=torch.bfloat16, device=device)]
  return args + [layout, torch.tensor([1, -2, 3], dtype=torch.int32, device=device), l2]


def differing_bits(kernel, device) -> tuple:
  """(outputs that differ in any bit between compiled and eager `kernel` on its probe, outputs)."""
  args = _probe(kernel, device)
  eager, compiled = ([a.clone() if torch.is_tensor(a) else a for a in args] for _ in range(2))
  want = kernel(*eager)
  with _compile_settings(device):
    got = _compiled(kernel)(*compiled)
  outputs = (0, 3, 4, 7) if kernel is _adamw_master_kernel else (0, 3, 4)
  pairs = [(want, got)] if kernel is _round_kernel else [(eager[i], compiled[i]) for i in outputs]
  as_int = lambda t: t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)
  return (sum(int((as_int(a) != as_int(b)).sum()) for a, b in pairs),
          sum(a.numel() for a, _ in pairs))


def _checked(kernel, device) -> bool:
  """Whether compiled `kernel` may run on `device`: on the CPU the suite checks it; elsewhere it
  must have eager's bits on the probe, checked once per process and device type."""
  if device.type == 'cpu':
    return True
  key = (kernel, device.type)
  if key not in _checks:
    differ, total = differing_bits(kernel, device)
    _checks[key] = differ == 0
    log = logging.info if _checks[key] else logging.warning
    log('bf16SR: compiled %s rounds %d of its probe\'s %d bf16 outputs differently from eager on %s (torch %s)%s',
        kernel.__name__, differ, total, device.type, torch.__version__, '' if _checks[key] else '; running it eagerly')
  return _checks[key]


def _run(kernel, device, *args):
  """kernel(*args), compiled where the device type allows; eager (the same bits) otherwise.
  Callers enter _compile_settings(device) around it (once for a whole step's calls)."""
  key = (kernel, device.type)
  if host_values.fake_in(args):       # a traced step: the eager kernel, the compile cache untouched
    host_values.note('the fused optimizer kernels run eagerly (their eager temporaries: an upper bound)')
    return kernel(*args)
  if device.type in COMPILED_DEVICES and key not in _failed:
    try:
      if _checked(kernel, device):
        return _compiled(kernel)(*args)   # compiles happen inside the first calls
      _failed.add(key)
    except Exception as e:  # pylint: disable=broad-except
      # Compiling fails before the kernel runs (no C++ compiler, an unsupported torch), so no
      # input has been written: the eager kernel computes the same bits, only slower.
      logging.warning('bf16SR: torch.compile of %s failed (%s: %s); running it eagerly',
                      kernel.__name__, type(e).__name__, str(e).splitlines()[0] if str(e) else '')
      _failed.add(key)
  return kernel(*args)


_layouts = {}


def _layout(box, global_shape, device):
  """(sizes, layout tensor on `device`) of stochastic_rounding.index_layout, made once per box: a tensor
  made from host values is a copy to the device, which on CUDA waits for the device's queue."""
  key = (tuple((s.start, s.stop, s.step) for s in box), tuple(global_shape), device)
  if key not in _layouts:
    sizes, layout = stochastic_rounding.index_layout(box, global_shape)
    _layouts[key] = sizes, torch.tensor(layout, dtype=stochastic_rounding.layout_dtype(global_shape), device=device)
  return _layouts[key]


def _seed(key, device):
  return torch.tensor(stochastic_rounding.key_seed(*key), dtype=torch.int32, device=device)


def round_at(x, box, global_shape, *key) -> torch.Tensor:
  """stochastic_rounding.stochastic_round_at(x, box, global_shape, *key), bit for bit, in one pass."""
  if x.numel() == 0:
    return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
  sizes, layout = _layout(box, global_shape, x.device)
  with _compile_settings(x.device):
    out = _run(_round_kernel, x.device, x.reshape(sizes), layout, _seed(key, x.device))
  return out.view(x.shape)


def square_sum(t) -> torch.Tensor:
  """grads.square_sum (the fp32 sum of squares), compiled on the CPU for tensors of at least
  precision.FUSED_FP32_MIN_NUMEL elements: one pass over them, where eager widens a 16-bit
  gradient to an fp32 copy and squares that into another (32M bf16 gradients: 34 -> 6 ms on
  two cores). Eager for smaller ones, which cost less than a compiled call (75 small
  gradients: 0.55 against 2.4 ms). Its loop sums in another order than eager's, so its bits
  are its own (norms are not layout-invariant bit for bit anyway: shards are summed in other
  orders)."""
  # CPU only: on CUDA inductor's dynamic-shape reduction was slow (874 ms of GPU time per step
  # for a 1.1B model's 201 gradients on an H100, torch 2.11); grads.square_sums takes torch's
  # multi-tensor norm there
  if t.device.type != 'cpu' or t.numel() < precision.FUSED_FP32_MIN_NUMEL:
    return grads.square_sum(t)
  with _compile_settings(t.device):
    return _run(grads.square_sum, t.device, t.reshape(-1))


def fusable(optimizer, device, dtype=torch.bfloat16) -> bool:
  """Whether `optimizer` is torch's Adam or AdamW with options adamw_step implements, for rows of
  `dtype` on a device type it is compiled for there: bf16 rows (bf16SR) on COMPILED_DEVICES,
  fp32 rows (an fp32 recipe's parameters, masters) on FP32_DEVICES. Elsewhere the eager
  pipeline is as fast."""
  devices = FP32_DEVICES if dtype == torch.float32 else COMPILED_DEVICES
  if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or device.type not in devices:
    return False
  # `fused` (flatron's CUDA default) only picks torch's kernel for the same step: the one pass
  # replaces it for the rows it updates
  return all(not g.get(flag) for g in optimizer.param_groups
             for flag in ('amsgrad', 'maximize', 'capturable', 'differentiable'))


def _scalars(group, step):
  """The scalars of _adamw_kernel for `group` at step count `step` (and whether the weight decay
  is Adam's L2), computed in Python floats as torch's single-tensor Adam does; the kernel gets
  them rounded to fp32 as its kernels round them."""
  lr, (beta1, beta2), eps, wd = group['lr'], group['betas'], group['eps'], group['weight_decay']
  decoupled = group.get('decoupled_weight_decay', False)
  bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
  values = [1 - lr * wd if decoupled else 1.0, 1 - beta1, beta2, 1 - beta2,
            bias_correction2**0.5, eps, -(lr / bias_correction1), 0.0 if decoupled else wd]
  return values, not decoupled and wd != 0


@torch.no_grad()
def adamw_step(optimizer, rows, grads, placement=None, keys=None, scale=None, narrow=None):
  """One Adam(W) step of `optimizer` (fusable) on `rows` (name -> the optimizer's param, written
  in place) from `grads` (bf16 or fp32) times `scale` (an fp32 0-dim tensor, the clip
  coefficient; None: 1, which changes no bit), state created and counted as torch's step would.
  bf16 rows are rounded stochastically: `placement`: name -> (box, global shape) of the rows;
  `keys`: name -> the rounding key of the rows, whose moments use key + ('exp_avg',) and
  key + ('exp_avg_sq',). fp32 rows need neither; `narrow`: name -> a contiguous tensor of
  another dtype, shaped as the fp32 rows of name (a master's parameter rows), that gets them
  rounded to nearest in the same pass."""
  narrow = narrow or {}
  names = {id(r): n for n, r in rows.items()}
  work, scalars, seeds, rows_of = [], [], [], {}     # host values: one copy of each to the device
  for group in optimizer.param_groups:
    for t in group['params']:
      name = names.get(id(t))
      if name is None or grads.get(name) is None:
        continue
      state = optimizer.state[t]
      if not state:                # torch's _init_group: a CPU step count, moments like t
        state['step'] = torch.tensor(0.0, dtype=torch.float32)
        state['exp_avg'] = torch.zeros_like(t, memory_format=torch.preserve_format)
        state['exp_avg_sq'] = torch.zeros_like(t, memory_format=torch.preserve_format)
      state['step'] += 1
      step = float(state['step'])
      if (id(group), step) not in rows_of:
        values, l2 = _scalars(group, step)
        rows_of[id(group), step] = len(scalars), l2
        scalars.append(values)
      if t.numel() == 0:
        continue
      seed = None
      if t.dtype != torch.float32:
        key, seed = keys[name], len(seeds)
        # a fourth, unused: each row 16-byte aligned, as triton's compiled kernels assume
        seeds.append([stochastic_rounding.key_seed(*key), stochastic_rounding.key_seed(*key, 'exp_avg'),
                      stochastic_rounding.key_seed(*key, 'exp_avg_sq'), 0])
      work.append((t, name, *rows_of[id(group), step], seed))
  if not work:
    return
  device = work[0][0].device
  calls = []           # (param, gradient, moment, moment, scalars row, L2, (layout, seeds row) or None, narrow)
  for t, name, row, l2, seed in work:
    state = optimizer.state[t]
    # fp32 flat (one graph for every shape); bf16 shaped as their index layout
    sizes, layout = ((-1,), None) if seed is None else _layout(*placement[name], device)
    calls.append((t.view(sizes), grads[name].reshape(sizes), state['exp_avg'].view(sizes),
                  state['exp_avg_sq'].view(sizes), row, l2, None if seed is None else (layout, seed),
                  narrow[name].view(sizes) if name in narrow else None))

  def launch(scale, scalars, seeds):
    # scalars[row] and seeds[...] are views of the step's two tensors (one more graph than
    # offset-0 tensors would compile, once; a clone per row: two more launches per tensor)
    for p, g, m, v, row, l2, keyed, out in calls:
      if out is not None:
        _run(_adamw_master_kernel, device, p, g, scale, m, v, scalars[row], l2, out)
      elif keyed is None:
        _run(_adamw_fp32_kernel, device, p, g, scale, m, v, scalars[row], l2)
      else:
        _run(_adamw_kernel, device, p, g, scale, m, v, scalars[row], keyed[0], seeds[keyed[1]], l2)

  with _compile_settings(device):
    scale = torch.ones((), device=device) if scale is None else scale.to(device=device, dtype=torch.float32)
    scalars = torch.tensor(scalars, dtype=torch.float32, device=device)
    seeds = torch.tensor(seeds, dtype=torch.int32, device=device) if seeds else None
    # on CUDA one graph replay from the third step on (optim/graphed.py), else the calls
    fixed = (x for call in calls for x in call[:6] + (call[6] or (None, None)) + call[7:])    # read on CUDA only
    graphed.run(launch, fixed, [scale, scalars, seeds])
