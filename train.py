"""flatron's one training loop.

    python train.py --config=configs/llama_tiny.py --workdir=runs/tiny
    python train.py --config=configs/llama7b.py:smoke --workdir=runs/s --config.trainer.max_steps=10

Sections: setup / data / init / step / loop (log, validate, stop). State the loop owns is
plain data: `params` (flat dict of tensors), the optimizer, and `consumed_samples` (the
whole data position). Every random draw is keyed, so nothing else needs saving.
"""
import json
import math
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags
import torch

from configs import validate as config_validation
from data.loader import Loader
from model import transformer
from optim import optimizers, schedules
from parallel import device as devices, memory, remat

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory: metrics.jsonl, TensorBoard, config.')


# ======================================================================================
# step
# ======================================================================================


def to_device(batch, device):
  return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_backward(params, micro_batches, config, device, training=True):
  """Accumulate grads of the global-token-mean loss; return (loss sum, token count).

  Each micro batch's summed loss is divided by the token count of the whole global batch,
  so the accumulated gradient is the same for any micro batch split (and, with the count
  summed over DP, for any DP degree).
  """
  m = config.model
  n_tokens = sum(mb['loss_mask'].sum() for mb in micro_batches).to(device)
  dropout = training and max(m.hidden_dropout, m.attention_dropout, m.ffn_dropout) > 0
  layer_fn = remat.layer_fn(m.activations_checkpoint_granularity) if training else None
  loss_sum = torch.zeros((), device=device)
  for mb in micro_batches:
    loss = transformer.loss_sum(params, to_device(mb, device), m,
                                dropout_key=(config.seed, 'dropout') if dropout else None,
                                layer_fn=layer_fn)
    if training:
      (loss / n_tokens).backward()
    loss_sum += loss.detach()
  return loss_sum, n_tokens


def grad_norm_and_clip(params, max_norm):
  grads = [p.grad for p in params.values() if p.grad is not None]
  norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
  if max_norm > 0:
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
  return norm


def train_step(params, optimizer, micro_batches, config, step, device):
  """One optimizer step. Returns metrics as tensors (no host sync here)."""
  loss_sum, n_tokens = forward_backward(params, micro_batches, config, device)
  grad_norm = grad_norm_and_clip(params, config.trainer.gradient_clip_val)
  lr = schedules.lr_at(step, config.model.optim.sched, config.model.optim.lr,
                       config.trainer.max_steps, config.model.hidden_size)
  for group in optimizer.param_groups:
    group['lr'] = lr
  loss = loss_sum / n_tokens
  finite = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))
  if finite:
    optimizer.step()
  elif config.trainer.nonfinite_policy == 'error':
    raise FloatingPointError(
        f'non-finite loss or gradient at step {step} (loss={loss.item()}, grad_norm={grad_norm.item()}); '
        'lower model.optim.lr, check the data, or set trainer.nonfinite_policy=skip')
  optimizer.zero_grad(set_to_none=True)
  return {'loss': loss, 'grad_norm': grad_norm, 'lr': lr, 'skipped': not finite}


@torch.no_grad()
def evaluate(params, loader, config, device, num_batches):
  total, tokens = 0.0, 0.0
  for i in range(num_batches):
    loss_sum, n = forward_backward(params, loader.global_batch(i * config.data.global_batch_size),
                                   config, device, training=False)
    total, tokens = total + loss_sum.item(), tokens + n.item()
  return total / max(tokens, 1.0)


def param_norm(params):
  return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach()) for p in params.values()]))


# ======================================================================================
# setup, summary, logging
# ======================================================================================


class MetricsLog:
  """metrics.jsonl (one JSON object per record) and, optionally, TensorBoard scalars."""

  def __init__(self, workdir, tensorboard):
    self.file = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    self.writer = None
    if tensorboard:
      from torch.utils.tensorboard import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.writer = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, record):
    self.file.write(json.dumps(record) + '\n')
    self.file.flush()
    if self.writer:
      for key, value in record.items():
        if key != 'step' and isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, record['step'])

  def close(self):
    self.file.close()
    if self.writer:
      self.writer.close()


def summary(config, dp, device, peak):
  m, a = config.model, config.data
  n_total, n_nonembed = transformer.count_params(m), transformer.count_params(m, embedding=False)
  est = memory.estimate(config, dp)
  tokens_per_step = a.global_batch_size * a.seq_length
  accum = a.global_batch_size // (a.micro_batch_size * dp)
  d = config.distributed_strategy
  lines = [
      f'flatron | {config.name} | device {device} | world dp={dp} tp={d.tensor_model_parallel_size} '
      f'pp={d.pipeline_model_parallel_size}',
      f'params {n_total:,} ({n_nonembed:,} non-embedding) | FLOPs/token '
      f'{transformer.flops_per_token(m, a.seq_length):.3e} (6N + 12Lhs)',
      f'batch: global {a.global_batch_size} x seq {a.seq_length} = {tokens_per_step:,} tokens/step | '
      f'micro {a.micro_batch_size} x {accum} accumulation steps x dp {dp}',
      'memory/rank (estimate): ' + ' | '.join(f'{k} {memory.human_bytes(v)}' for k, v in est.items()),
      f'MFU peak: {peak[0]:.3e} FLOP/s ({peak[1]})',
  ]
  return '\n'.join(lines)


def fmt_eta(seconds):
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


# ======================================================================================
# loop
# ======================================================================================


def run(config, workdir):
  """Train `config`, writing to `workdir`. Returns the last logged record."""
  dp = config_validation.validate(config)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  device = devices.resolve(config.device)
  peak = devices.peak_flops(device)
  logging.info('\n%s', summary(config, dp, device, peak))

  # --- data
  train_data = Loader(config, 'train')
  valid_data = Loader(config, 'valid')

  # --- init
  params = transformer.init(config.model, config.seed, device=device)
  optimizer = optimizers.make_optimizer(params, config.model.optim)
  consumed_samples = 0

  log = MetricsLog(workdir, config.exp_manager.create_tensorboard_logger)
  t = config.trainer
  if t.num_sanity_val_steps:
    logging.info('sanity validation: val_loss %.4f',
                 evaluate(params, valid_data, config, device, t.num_sanity_val_steps))

  tokens_per_step = config.data.global_batch_size * config.data.seq_length
  flops_per_token = transformer.flops_per_token(config.model, config.data.seq_length)
  window_start, window_steps, record = time.perf_counter(), 0, {}
  for step in range(t.max_steps):
    out = train_step(params, optimizer, train_data.global_batch(consumed_samples), config, step, device)
    consumed_samples += config.data.global_batch_size
    window_steps += 1
    last = step + 1 == t.max_steps
    if (step + 1) % t.log_every_n_steps == 0 or last:
      devices.synchronize(device)
      elapsed = (time.perf_counter() - window_start) / window_steps
      tokens_per_sec = tokens_per_step / elapsed
      record = {'step': step + 1, 'loss': out['loss'].item(), 'lr': out['lr'],
                'grad_norm': out['grad_norm'].item(), 'tokens_per_sec': tokens_per_sec,
                'mfu': tokens_per_sec * flops_per_token / peak[0], 'step_time': elapsed,
                'consumed_samples': consumed_samples}
      if out['skipped']:
        record['skipped'] = True
      if config.exp_manager.log_parameter_norm:
        record['param_norm'] = param_norm(params).item()
      logging.info('step %d/%d | loss %.4f | lr %.3e | grad_norm %.3f | %s tok/s | MFU %.2f%% | '
                   '%.3f s/step | ETA %s', step + 1, t.max_steps, record['loss'], record['lr'],
                   record['grad_norm'], f'{tokens_per_sec:,.0f}', 100 * record['mfu'], elapsed,
                   fmt_eta(elapsed * (t.max_steps - step - 1)))
      log.write(record)
      window_start, window_steps = time.perf_counter(), 0
    if t.val_check_interval and ((step + 1) % t.val_check_interval == 0 or last) and t.limit_val_batches:
      val_loss = evaluate(params, valid_data, config, device, t.limit_val_batches)
      logging.info('step %d | val_loss %.4f', step + 1, val_loss)
      log.write({'step': step + 1, 'val_loss': val_loss, 'consumed_samples': consumed_samples})
      record['val_loss'] = val_loss
      window_start = time.perf_counter()    # validation time is not training throughput
  log.close()
  logging.info('done: %d steps | metrics %s | TensorBoard %s', t.max_steps,
               os.path.join(workdir, 'metrics.jsonl'), os.path.join(workdir, 'tensorboard'))
  return record, params


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _WORKDIR.value is None:
    raise app.UsageError('--workdir is required (where metrics.jsonl and TensorBoard logs go)')
  try:
    run(_CONFIG.value, _WORKDIR.value)
  except config_validation.ConfigError as e:
    raise SystemExit(f'error: {e}') from None


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
