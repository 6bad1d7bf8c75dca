"""The training loop's view of checkpoints: restore or initialize, save on schedule, stop.

Keys (exp_manager, NxD Training's names): create_checkpoint_callback,
checkpoint_callback_params.{save_top_k, every_n_train_steps, monitor, mode, save_last,
filename}, async_checkpointing, resume_if_exists, resume_ignore_no_checkpoint,
resume_from_checkpoint, plus checkpoint_dir (default <workdir>/checkpoints; s3://... and
gs://... work) and init_from (weights only, from a flatron checkpoint step or a Hugging Face
Llama directory, to start fine-tuning).

Stopping early (SIGTERM, the first Ctrl-C, trainer.exit_interval) always saves, even with
periodic checkpoints off, so the run can be resumed; that step is never pruned by its rank.
With a validation metric as `monitor` the loop validates before every save (`needs_metrics`)
and the record goes into the step's metadata.json, which pruning ranks by. The newest step is
kept when save_last or resume_if_exists is set: resume starts from it.
"""
import datetime
import logging
import os
import threading

import torch.distributed as dist

from checkpoint import (manager as managers, nxd_files, nxd_params, preemption, state as states, steps as checkpoint_steps,
                        storage, store)
from model import adapters, hf, lora, param_table
from parallel import comm


def check_writable(root, rank):
  """Fail at start-up, naming the directory, when checkpoints could not be written there."""
  probe = f'.write_probe.rank{rank}'
  try:
    if not storage.is_remote(root):
      os.makedirs(storage.kvstore_spec(root)['path'], exist_ok=True)
    storage.write_text(root, probe, 'ok')
    storage.delete(root, probe)
  except Exception as e:  # pylint: disable=broad-except
    raise managers.IncompatibleCheckpoint(
        f'checkpoint directory {root} is not writable ({str(e).splitlines()[0]}); fix its '
        'permissions or set exp_manager.checkpoint_dir to a writable place') from None


def check_shapes(path, meta, layout):
  """Refuse a checkpoint of another model before reading anything: every parameter this
  model has must be stored with the same global shape, and the checkpoint must hold no other."""
  stored = {n: tuple(a['shape']) for n, a in meta.get('arrays', {}).items()
            if not n.startswith(('optim.', 'master.'))}
  mine = {n: tuple(lay.shape) for n, lay in layout.layouts().items()
          if not n.startswith(('optim.', 'master.'))}
  problems = [f'{n}: checkpoint {list(stored[n])}, model {list(mine[n])}'
              for n in mine if n in stored and stored[n] != mine[n]]
  problems += [f'{n}: missing from the checkpoint' for n in mine if n not in stored]
  problems += [f'{n}: in the checkpoint, not in the model' for n in stored if n not in layout.specs]
  if problems:
    shown = '\n  - '.join(problems[:5]) + (f'\n  ... and {len(problems) - 5} more' if len(problems) > 5 else '')
    raise managers.IncompatibleCheckpoint(
        f'{path} holds a different model ({len(problems)} parameter(s) differ):\n  - {shown}\n'
        f'Set model.* to the checkpoint\'s (its config is in {path}/metadata.json) or use another '
        'workdir / checkpoint; nothing was loaded or deleted.')


def _newest_readable(candidates):
  """(step, its metadata) of the newest candidate whose metadata.json reads (else the oldest's
  error): the manager tries, and moves aside, a damaged newer one itself."""
  for step in candidates[:-1]:
    try:
      return step, checkpoint_steps.read_metadata(step)
    except store.ChecksumError:
      continue
  return candidates[-1], checkpoint_steps.read_metadata(candidates[-1])


class Session:

  def __init__(self, config, workdir, mesh, updater):
    self.config, self.mesh, self.updater = config, mesh, updater
    e, t = config.exp_manager, config.trainer
    self.enabled = e.create_checkpoint_callback
    self.every = e.checkpoint_callback_params.every_n_train_steps
    self.exit_interval = t.exit_interval
    self.root = e.checkpoint_dir or os.path.join(workdir, 'checkpoints')
    # The manager's collectives run in its writer thread: they get their own gloo group.
    timeout = datetime.timedelta(seconds=mesh.timeout_s)
    self.group = dist.new_group(backend='gloo', timeout=timeout) if mesh.world_size > 1 else None
    p = e.checkpoint_callback_params
    self.needs_metrics = p.monitor != 'step'
    self.manager = managers.CheckpointManager(
        self.root, rank=mesh.rank, world_size=mesh.world_size, group=self.group, save_top_k=p.save_top_k,
        monitor=p.monitor, mode=p.mode, save_last=p.save_last or e.resume_if_exists, filename=p.filename,
        async_save=e.async_checkpointing)
    self.signals = preemption.StopSignals(install=threading.current_thread() is threading.main_thread())
    self.last_saved = None
    if self.enabled or self.exit_interval:
      comm.on_every_rank(lambda: check_writable(self.root, mesh.rank), mesh.host_group,
                         'checking the checkpoint directory')

  # --- start ------------------------------------------------------------------------

  def restore_or_init(self):
    """Resume (params, optimizer, data position) or load init_from weights. -> (step, consumed)."""
    e = self.config.exp_manager
    # an NxD Training checkpoint to start from (named, or NxD's tags in this run's checkpoint
    # directory with resume_if_exists): this run's own steps, once it has saved some, come first
    nxd = (e.resume_from_checkpoint if e.resume_from_checkpoint and nxd_files.is_nxd_checkpoint(e.resume_from_checkpoint)
           else self.root if e.resume_if_exists and not storage.is_remote(self.root) and nxd_files.is_nxd_checkpoint(self.root)
           else None)
    if nxd:
      candidates = self.manager.candidates(True, True, None) if self.manager.committed_steps() else []
    else:
      candidates = self.manager.candidates(e.resume_if_exists, e.resume_ignore_no_checkpoint, e.resume_from_checkpoint)
    if candidates:
      readable, meta = _newest_readable(candidates)
      names = self._resume_names(readable, meta)
      layout = states.StateLayout(self.config, self.mesh, self.updater, meta.get('optimizer_state_keys', ()),
                                  names=names)
      step, arrays, meta = self.manager.resume(layout.requests(), candidates=candidates,
                                               check=lambda p, m: check_shapes(p, m, layout))
      layout.restore(arrays, meta.get('optimizer_step', 0))
      self.last_saved = step
      logging.info('resumed from %s: step %d, consumed_samples %d (saved at %s)',
                   meta['path'], step, meta['consumed_samples'], meta.get('layout'))
      return step, meta['consumed_samples']
    start = (0, 0)
    if nxd:                                # NxD's weights, step and data position (its base, with LoRA)
      start = self._resume_from_nxd(nxd)
    elif e.init_from:
      self._init_from(e.init_from)
    peft = lora.settings(self.config.model)
    if peft is not None and peft.load_lora_from_ckpt:
      self._load_adapters(lora.adapter_source(peft))
    return start

  def _resume_from_nxd(self, path):
    """Parameters, step and consumed samples of an NxD Training checkpoint, at this run's layout
    (each process reads the checkpoint whole: for a large model convert it once with
    tools.convert nxd-to-flatron and resume from that)."""
    tag = nxd_files.open_tag(path)
    merged = nxd_params.merge(tag, self.config.model)
    progress = nxd_files.progress(tag)
    specs = param_table.param_specs(self.config.model, self.mesh.tp)
    layout = states.StateLayout(self.config, self.mesh, self.updater, names=[n for n in specs if not lora.is_adapter(n)],
                                weights_only=True)
    layout.restore({n: merged[n][tuple(box)] for n, box in layout.requests().items() if n in merged}, 0,
                   weights_only=True)
    step, consumed = progress['step'], progress['consumed_samples']
    if consumed is None:
      consumed = step * self.config.data.global_batch_size
      logging.warning('%s: its name holds no consumed_samples; taking step x global_batch_size = %d', tag.path, consumed)
    logging.warning('resumed from NxD checkpoint %s: step %d, consumed_samples %d (saved at tp %d pp %d ep %d); '
                    'optimizer state not carried: moments start at zero', tag.path, step, consumed, tag.tp, tag.pp,
                    tag.ep)
    return step, consumed

  def starting_adapters(self, params):
    """`params` (fresh boxes of this rank's trainable parameters: adapters, trained biases) with
    load_lora_from_ckpt's values loaded into them: what the run started from (DPO's
    reference), read again on resume."""
    self._load_adapters(lora.adapter_source(lora.settings(self.config.model)), params)
    return {n: p.detach().requires_grad_(False) for n, p in params.items()}

  def _load_adapters(self, path, params=None):
    """load_lora_from_ckpt: the adapters (weights only) of a peft directory or a flatron step,
    into the updater's parameters or `params`."""
    specs = param_table.param_specs(self.config.model, self.mesh.tp)
    layout = states.StateLayout(self.config, self.mesh, self.updater, names=lora.trainable(self.config.model, specs),
                                weights_only=True)
    requests = layout.requests()
    if adapters.is_peft_dir(path):
      arrays = adapters.read_boxes(path, requests, self.config.model)
    else:
      check_shapes(path, checkpoint_steps.read_metadata(path), layout)
      arrays, _ = self.manager.load(path, requests)
    layout.restore(arrays, 0, weights_only=True, params=params)
    logging.info('loaded LoRA adapters from %s', path)

  def _resume_names(self, path, meta):
    """The parameters to read when resuming from step `path`. A LoRA step holding adapters
    only needs its base from exp_manager.init_from, which is loaded here first."""
    specs = param_table.param_specs(self.config.model, self.mesh.tp)
    stored = meta.get('lora', {}).get('stored', 'all')
    peft = lora.settings(self.config.model)
    if peft is None and stored != 'all':
      raise managers.IncompatibleCheckpoint(
          f'{path} holds LoRA adapters ({stored}) but LoRA is off; set model_alignment_strategy.peft as '
          f'when it was saved (its config is in {path}/metadata.json)')
    if peft is None:
      return None
    if stored == 'merged':
      raise managers.IncompatibleCheckpoint(
          f'{path} holds a merged model (merge_lora=True), which cannot resume LoRA training; use it as '
          'exp_manager.init_from of a new run, or resume from a step saved with merge_lora=False')
    if stored == 'all':
      raise managers.IncompatibleCheckpoint(
          f'{path} is a full checkpoint without LoRA adapters; start the LoRA run from it with '
          'exp_manager.init_from (in a new workdir) instead of resuming')
    if stored == 'adapters+base':
      return list(specs)
    if not self.config.exp_manager.init_from:
      raise managers.IncompatibleCheckpoint(
          f'{path} holds LoRA adapters only; set exp_manager.init_from to the base model they were '
          'trained on (an HF directory or a flatron step), or save with peft.save_lora_base=True')
    self._init_from(self.config.exp_manager.init_from)
    return lora.trainable(self.config.model, specs)

  def load_init_weights(self, params):
    """`params` (fresh init boxes of this rank) with exp_manager.init_from's weights loaded
    into them, when it names any: the run's starting model (the DPO reference)."""
    if self.config.exp_manager.init_from:
      self._init_from(self.config.exp_manager.init_from, params)
    return {n: p.detach().requires_grad_(False) for n, p in params.items()}

  def _init_from(self, path, params=None):
    """Weights only: a Hugging Face Llama directory or a flatron checkpoint step (the base
    model; LoRA adapters keep their init, or load_lora_from_ckpt's), into the updater's
    parameters or `params`."""
    specs = param_table.param_specs(self.config.model, self.mesh.tp)
    layout = states.StateLayout(self.config, self.mesh, self.updater, names=[n for n in specs if not lora.is_adapter(n)],
                                weights_only=True)
    requests = layout.requests()
    if not storage.is_remote(path) and nxd_files.is_nxd_checkpoint(path):       # NxD Training's tag (any layout)
      merged = nxd_params.merge(nxd_files.open_tag(path), self.config.model)
      arrays = {n: merged[n][tuple(box)] for n, box in requests.items() if n in merged}
    elif storage.read_text(path, 'config.json') is not None and not checkpoint_steps.is_committed(path):
      hf_model = hf.read_config(path, self.config.model)
      self._check_same_model(hf_model)
      arrays = hf.read_boxes(path, hf_model, requests)   # this rank's boxes only
    else:
      try:
        meta = checkpoint_steps.read_metadata(path)
      except store.CheckpointError as e:
        raise store.CheckpointError(
            f'exp_manager.init_from (NxD: resume_from_checkpoint with weight_init_only): {e}; point it at an HF '
            'model directory or a committed flatron checkpoint step') from None
      check_shapes(path, meta, layout)
      arrays, _ = self.manager.load(path, requests)
    layout.restore(arrays, 0, weights_only=True, params=params)
    logging.info('initialized weights from %s', path)

  def _check_same_model(self, other):
    mine = self.config.model
    keys = ('num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads', 'vocab_size',
            'share_embeddings_and_output_weights')
    diff = [f'model.{k}: config {mine[k]} vs checkpoint {other[k]}' for k in keys if mine[k] != other[k]]
    if param_table.kv_heads(mine) != param_table.kv_heads(other):
      diff.append(f'model.num_kv_heads: config {mine.num_kv_heads} vs checkpoint {other.num_kv_heads}')
    if diff:
      raise managers.IncompatibleCheckpoint(
          'exp_manager.init_from: the checkpoint is a different model; set these to match it:\n  - '
          + '\n  - '.join(diff))

  # --- during and after the loop -------------------------------------------------------

  def stop_reason(self, step):
    """Why the run stops after `step` (all ranks agree), or None: a signal, or exit_interval."""
    if self.signals.agree(self.mesh.host_group):
      return self.signals.agreed
    if self.exit_interval and step % self.exit_interval == 0:
      return 'trainer.exit_interval'
    return None

  def due(self, step, last=False, stopping=False):
    """Whether maybe_save(step, ...) with these flags will save."""
    due = stopping or (self.enabled and (last or (self.every and step % self.every == 0)))
    return due and self.last_saved != step

  def maybe_save(self, step, consumed_samples, last=False, stopping=False, metrics=None):
    """Save `step` when due; `metrics` (the step's validation record) goes into metadata.json.
    A stop's save is pinned: resume needs it whatever its rank."""
    if not self.due(step, last, stopping):
      return
    layout = states.StateLayout(self.config, self.mesh, self.updater)
    extra = {'lora': {'stored': lora.checkpoint_kind(self.config.model)}} if lora.settings(self.config.model) else {}
    if metrics:
      extra['metrics'] = dict(metrics)
    meta = states.step_metadata(self.config, self.mesh, consumed_samples, layout.state_keys,
                                self.updater.optimizer_step(), **extra)
    self.manager.save(step, layout.local_tensors(), layout.layouts(), meta, pin=stopping)
    self.last_saved = step

  def close(self):
    self.signals.restore()
    self.manager.wait()
