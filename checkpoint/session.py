"""The training loop's view of checkpoints: restore or initialize, save on schedule, preemption.

Keys (exp_manager, NxD Training's names): create_checkpoint_callback,
checkpoint_callback_params.{save_top_k, every_n_train_steps}, async_checkpointing,
resume_if_exists, resume_ignore_no_checkpoint, resume_from_checkpoint, plus checkpoint_dir
(default <workdir>/checkpoints; s3://... and gs://... work) and init_from (weights only, from
a flatron checkpoint step or a Hugging Face Llama directory, to start fine-tuning).
"""
import json
import logging
import os
import signal

import torch
import torch.distributed as dist

from checkpoint import manager as managers, state as states, storage
from model import hf, transformer


class Session:

  def __init__(self, config, workdir, mesh, updater):
    self.config, self.mesh, self.updater = config, mesh, updater
    e = config.exp_manager
    self.enabled = e.create_checkpoint_callback
    self.every = e.checkpoint_callback_params.every_n_train_steps
    self.root = e.checkpoint_dir or os.path.join(workdir, 'checkpoints')
    # The manager's collectives run in its writer thread: they get their own gloo group.
    self.group = dist.new_group(backend='gloo') if mesh.world_size > 1 else None
    self.manager = managers.CheckpointManager(
        self.root, rank=mesh.rank, world_size=mesh.world_size, group=self.group,
        keep_last=e.checkpoint_callback_params.save_top_k, async_save=e.async_checkpointing)
    self.preempted = False
    self.last_saved = None
    if self.enabled:
      signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):  # pylint: disable=unused-argument
    logging.warning('SIGTERM: saving a checkpoint after this step, then exiting')
    self.preempted = True

  # --- start ------------------------------------------------------------------------

  def restore_or_init(self):
    """Resume (params, optimizer, data position) or load init_from weights. -> (step, consumed)."""
    e = self.config.exp_manager
    if e.resume_if_exists or e.resume_from_checkpoint:
      path = self.manager.resolve_resume(e.resume_if_exists, e.resume_ignore_no_checkpoint,
                                         e.resume_from_checkpoint)
      if path is not None:
        meta = managers.read_metadata(path)
        layout = states.StateLayout(self.config, self.mesh, self.updater, meta.get('optimizer_state_keys', ()))
        found = self.manager.resume(layout.requests(), resume_if_exists=e.resume_if_exists,
                                    resume_ignore_no_checkpoint=e.resume_ignore_no_checkpoint,
                                    resume_from_checkpoint=e.resume_from_checkpoint)
        step, arrays, meta = found
        layout.restore(arrays, meta.get('optimizer_step', 0))
        self.last_saved = step
        logging.info('resumed from %s: step %d, consumed_samples %d (saved at %s)', path, step,
                     meta['consumed_samples'], meta.get('layout'))
        return step, meta['consumed_samples']
    if e.init_from:
      self._init_from(e.init_from)
    return 0, 0

  def _init_from(self, path):
    """Weights only: a Hugging Face Llama directory or a flatron checkpoint step."""
    layout = states.StateLayout(self.config, self.mesh, self.updater, state_keys=())
    requests = {n: b for n, b in layout.requests().items() if not n.startswith(('optim.', 'master.'))}
    if storage.read_text(path, 'config.json') is not None and not managers.is_committed(path):
      hf_config, full = hf.load_hf(path)
      self._check_same_model(hf_config.model)
      arrays = {n: full[n][box] for n, box in requests.items()}
    else:
      arrays, _ = self.manager.load(path, requests)
    layout.restore(arrays, 0, weights_only=True)
    logging.info('initialized weights from %s', path)

  def _check_same_model(self, other):
    mine = self.config.model
    keys = ('num_layers', 'hidden_size', 'ffn_hidden_size', 'num_attention_heads', 'vocab_size',
            'share_embeddings_and_output_weights')
    diff = [f'model.{k}: config {mine[k]} vs checkpoint {other[k]}' for k in keys if mine[k] != other[k]]
    if transformer.kv_heads(mine) != transformer.kv_heads(other):
      diff.append(f'model.num_kv_heads: config {mine.num_kv_heads} vs checkpoint {other.num_kv_heads}')
    if diff:
      raise ValueError('exp_manager.init_from: the checkpoint is a different model; set these to '
                       'match it:\n  - ' + '\n  - '.join(diff))

  # --- during and after the loop -------------------------------------------------------

  def should_stop(self):
    """Whether any rank got SIGTERM (agreed by all ranks, so all save the same step)."""
    flag = torch.tensor([int(self.preempted)])
    if self.mesh.world_size > 1:
      dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
    self.preempted = bool(flag.item())
    return self.preempted

  def maybe_save(self, step, consumed_samples, last=False):
    due = self.enabled and (last or self.preempted or (self.every and step % self.every == 0))
    if not due or self.last_saved == step:
      return
    layout = states.StateLayout(self.config, self.mesh, self.updater)
    d = self.config.distributed_strategy
    meta = {'consumed_samples': consumed_samples, 'config': json.loads(self.config.to_json_best_effort()),
            'layout': {'dp': self.mesh.dp, 'pp': self.mesh.pp, 'tp': self.mesh.tp,
                       'vp': d.virtual_pipeline_model_parallel_size, 'zero1': d.zero1},
            'optimizer_state_keys': layout.state_keys,
            'optimizer_step': states.optimizer_step(self.updater)}
    self.manager.save(step, layout.local_tensors(), layout.layouts(), meta)
    self.last_saved = step

  def close(self):
    self.manager.wait()
