"""When and how a training run evaluates (train.py's loop calls these): whether it reads the
validation split at all, whether validation is due after a step, and one evaluation pass
printed and recorded as {prefix}_loss and {prefix}_<metric>."""
from absl import logging

import logs
from parallel import passes


def evaluate_and_log(run, prefix, num_batches, step, consumed_samples):
  """Evaluate `num_batches` global batches of the split `prefix` ('val': validation, 'test') of
  `run` (train.Run: its params, data, config, mesh, ops, reference model and log); print and
  record them as {prefix}_loss and {prefix}_<metric>, which are returned."""
  loader = run.data['valid' if prefix == 'val' else prefix]
  loss, metrics = passes.evaluate(run.params, loader, run.config, run.mesh, run.ops, num_batches, run.reference)
  values = {f'{prefix}_loss': loss, **{f'{prefix}_{k}': v for k, v in metrics.items()}}
  logging.info('step %d | %s', step, ' | '.join(f'{k} {v:.4f}' for k, v in values.items()))
  run.log.write({'step': step, f'{prefix}_loss': loss, 'consumed_samples': consumed_samples, **values})
  return values


def validates(config) -> bool:
  """Whether the run reads the validation split at all (NxD's limit_val_batches: 0.0 = never):
  sanity steps, periodic validation, or saves ranked by a validation metric."""
  t = config.trainer
  ranked = config.exp_manager.checkpoint_callback_params.monitor != 'step'
  return bool(t.num_sanity_val_steps or (t.limit_val_batches and (t.val_check_interval or t.check_val_every_n_epoch
                                                                  or ranked)))


def due(t, train_data, step, last, before, after):
  """Whether to validate after `step` (consumed samples went from `before` to `after`): every
  val_check_interval steps and at the end, and on the step completing every
  check_val_every_n_epoch-th epoch."""
  periodic = t.val_check_interval and (logs.every(step, t.val_check_interval) or last)
  epochs = t.check_val_every_n_epoch and train_data.crosses_epochs(before, after, t.check_val_every_n_epoch)
  return bool(t.limit_val_batches and (periodic or epochs))
