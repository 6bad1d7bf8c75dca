"""Where every NxD Training key goes in flatron: the table configs/nxd_yaml.py applies.

`RULES` holds the keys whose flatron place or meaning differs: renamed (with a conversion),
or not applicable here (with the reason, and the values that mean what flatron does anyway;
any other value is an error). A key at the same path in configs/base.py maps to itself and
needs no entry. `DOCUMENTED` lists the keys of NxD Training's "YAML Configuration Settings"
page and example configs; `table()` is docs/nxd-migration.md's side-by-side table of them.
"""
import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one NxD key maps: to a flatron key (through `convert`), or not at all (`reason`).
  `allowed`: for a key not honoured, the values that mean what flatron does anyway; any other
  value is an error, since silently running something else would be wrong."""
  target: Optional[str] = None
  reason: Optional[str] = None
  convert: Optional[Callable[[Any], Any]] = None
  allowed: tuple = ()
  exported: bool = True     # False: another NxD name of a key `to_tree` writes under its main name


def _na(reason, *allowed):
  return Rule(reason=reason, allowed=allowed)


def _batches(value):
  """Lightning's limit_*_batches / val_check_interval: an int count, or a float fraction."""
  if isinstance(value, float):
    if value == 0.0:
      return 0
    raise ValueError(f'{value} is a fraction of the split (Lightning\'s float form); flatron counts global '
                     'batches: give an int')
  return value


_RECOMPUTE_PARTS = {'coreattention': 'attention', 'attention': 'attention', 'mlp': 'mlp',
                    'llamamlp': 'mlp', 'mistralmlp': 'mlp', 'llamarmsnorm': 'norm', 'norm': 'norm',
                    'activationmultiplymlp': 'activation', 'activation': 'activation'}


def _recompute(parts):
  out = []
  for part in parts or ():
    name = _RECOMPUTE_PARTS.get(str(part).lower())
    if name is None:
      raise ValueError(f'{part!r} is not a module flatron recomputes; valid: CoreAttention (attention), LlamaMLP '
                       '(mlp), LlamaRMSNorm (norm), ActivationMultiplyMLP (activation)')
    out.append(name)
  return tuple(dict.fromkeys(out))


def _pipeline_cuts(names):
  """NxD's model.pipeline_cuts, the layers each stage ends with ('model.layers.18'), as
  flatron's stage starts (19)."""
  out = []
  for name in names or ():
    index = str(name).rsplit('.', 1)[-1]
    if not (str(name).removeprefix('model.').startswith('layers.') and index.isdigit()):
      raise ValueError(f'{name!r} is not a decoder layer name; give model.layers.<i> (the last layer of a stage)')
    out.append(int(index) + 1)
  return tuple(out)


TORCHRUN = 'processes come from torchrun (--nproc_per_node x --nnodes); dp is what tp x pp leave of them'
XSER = ('flatron saves tensorstore arrays, layout-free and async; NxD checkpoints, xser or not, are read '
        'either way (resume_from_checkpoint)')
MANUAL = 'read only with precision.type=manual (as in NxD Training)'
XLA_DTYPE = 'flatron casts per tensor; no XLA_USE_BF16-style global downcast'

RULES = {
    'trainer.devices': _na(TORCHRUN),
    'trainer.num_nodes': _na(TORCHRUN),
    'trainer.val_check_interval': Rule('trainer.val_check_interval', convert=_batches),
    'trainer.limit_val_batches': Rule('trainer.limit_val_batches', convert=_batches),
    # NxD Training's training script runs no test loop, so its files' limit_test_batches does nothing there;
    # here it would start one (and ask for test data), so it is reported, and the run keeps flatron's 0
    'trainer.limit_test_batches': _na('NxD Training runs no test loop; flatron\'s own test pass after training is '
                                      '--config.trainer.limit_test_batches'),
    'exp_manager.exp_log_dir': Rule('exp_manager.explicit_log_dir', exported=False),      # the settings page's name for it
    'exp_manager.checkpoint_callback_params.model_parallel_size': _na('checkpoints load at any tp x pp'),
    'exp_manager.log_gradient_norm': _na('grad_norm is on every logged step', True, False),
    'exp_manager.enable_recovery_time_instrumentation': _na('checkpoint save and load times are always logged',
                                                            True, False),
    'exp_manager.save_xser': _na(XSER, True, False),
    'exp_manager.load_xser': _na(XSER, True, False),
    'exp_manager.save_bf16': _na('every array is stored in its training dtype', False),
    'exp_manager.ckpt_ptl_version': _na('no PyTorch Lightning: checkpoints are flatron steps'),
    # NeMo's WandbLogger / MLFlowLogger kwargs with no flatron setting of their own
    'exp_manager.wandb_logger_kwargs.resume': _na('a resumed run continues its own W&B run (<workdir>/trackers.json)'),
    'exp_manager.wandb_logger_kwargs.log_model': _na('checkpoints are not uploaded as W&B artifacts', False),
    'exp_manager.wandb_logger_kwargs.version': Rule('exp_manager.wandb_logger_kwargs.id', exported=False),
    'exp_manager.mlflow_logger_kwargs.log_model': _na('checkpoints are not logged as MLflow artifacts', False),
    'data.data_impl': _na('Megatron .bin/.idx are memory-mapped (the only implementation)', 'mmap'),
    'data.skip_warmup': _na('the index is memory-mapped lazily: nothing to warm up', True, False),
    'data.num_workers': _na('batches are built in the training process, keyed by sample index'),
    'data.dataloader_type': _na('one sampler, resumable by consumed samples (Megatron\'s single)', 'single'),
    'data.validation_drop_last': _na('validation reads whole global batches (limit_val_batches)', True, False),
    'data.no_seqlen_plus_one_input_tokens': _na('samples are seq_length + 1 tokens (Megatron\'s default)', False),
    'data.pad_samples_to_global_batch_size': _na('every step is a whole global batch', False),
    'data.packing': Rule('model_alignment_strategy.sft.packing'),
    'data.use_sft_style_data_module': _na('records are read from data.train_dir whenever it is set', True, False),
    'data.tokenizer.delimiter': _na('no tabular tokenizer', None),
    'data.tokenizer.sentencepiece_legacy': _na('special tokens come from the tokenizer file', False, True),
    'data.tokenizer.use_fast': _na('HF tokenizers run on the `tokenizers` library (the fast one)', True, False),
    'model.encoder_seq_length': Rule('data.seq_length'),     # data.seq_length, when the YAML sets it, wins
    'model.kv_channels': Rule('model.head_dim', convert=lambda v: v or 0),
    'model.do_layer_norm_weight_decay': Rule('model.optim.do_layer_norm_weight_decay'),
    'model.fusions.do_layer_norm_weight_decay': Rule('model.optim.do_layer_norm_weight_decay', exported=False),
    'model.fusions.softmax': _na('softmax is SDPA\'s, or fp32 in the explicit path', True, False),
    'model.persist_layer_norm': _na('norms are plain PyTorch', True, False),
    'model.transformer_block_type': _na('blocks are pre-norm (sandwich_norm adds Gemma\'s post-norms)', 'pre_ln'),
    'model.use_cpu_initialization': _na('init is keyed by (seed, name): the same on every device', True, False),
    'model.qkv_linear': _na('q, k, v are column-parallel; kv_replicator copies KV heads when tp > kv heads',
                            True, False),
    'model.fuse_qkv': _na('q, k, v are separate column-parallel GEMMs (names stay HF\'s)', True, False),
    'model.weight_init_only': Rule('exp_manager.init_from', exported=False),    # applied in `load`: see there
    'model.activations_checkpoint_recompute': Rule('model.activations_checkpoint_recompute', convert=_recompute),
    'model.micro_batch_size': Rule('data.micro_batch_size', exported=False),          # NeMo's place for it
    'model.global_batch_size': Rule('data.global_batch_size', exported=False),
    'model.transpose_nki_inputs': _na('the layout of NKI flash-attention inputs on Neuron; attention here is SDPA '
                                      'or the explicit path', True, False),
    'model.pipeline_cuts': Rule('distributed_strategy.pipeline_cuts', convert=_pipeline_cuts, exported=False),
    'model.sliding_window_size': Rule('model.sliding_window', convert=lambda v: v or 0, exported=False),
    'trainer.lnc': _na('logical NeuronCore grouping on trn2; one process per device here (torchrun)'),
    'trainer.sequential_move_factor': _na('init is keyed by (seed, name) and runs on every rank at once: no '
                                          'staged moves to the device'),
    'exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt': _na(
        'checkpoints always hold the fp32 masters (master.* arrays) beside the bf16 parameters, so a resume is '
        'exact; NxD\'s False re-derives them from the bf16 weights', True, False),
    'model.moe.sinkhorn_tol': Rule('model.moe.sinkhorn_tol', convert=lambda v: None if v in (None, 'None') else float(v)),
    'distributed_strategy.token_shuffle_group_size': _na('1 = no token shuffle: tokens route per sequence, so which '
                                                         'drop is layout-free; shuffling them over DP ranks is not built', 1),
    'model.optim.capturable': _na('set by the device: capturable on XLA, not elsewhere', True, False),
    'model_alignment_strategy.peft.lora_verbose': _na('the start-up summary always shows the adapters', True, False),
    'model_alignment_strategy.peft.save_lora_config_adapter': _na(
        'adapters are saved with their config; python -m tools.convert export-peft writes a peft directory', True, False),
    'model_alignment_strategy.peft.merge_sharded_lora': _na('checkpoints are layout-free: adapters are never '
                                                            'sharded on disk', True, False),
}
# The Neuron compiler / runtime keys keep their names; parallel/xla.py reports them at start-up
# on a device where they do nothing. precision's knobs are read only with type manual, as
# in NxD Training: NxD knob -> (flatron knob, its value for the YAML's).
TOKENIZER_KEYS = ('library', 'type', 'model', 'vocab_file', 'merge_file')   # read as a section
MANUAL_KNOBS = {
    'master_weights': ('master_weights', bool),
    'fp32_grad_acc': ('fp32_grad_acc', bool),
    'xla_use_bf16': ('parameter_dtype', lambda v: 'bf16' if int(v) else 'fp32'),
    'neuron_rt_stochastic_rounding_en': ('stochastic_rounding', lambda v: bool(int(v))),
    'xla_downcast_bf16': (None, None),
}
# precision keys read with every type (not knobs of `manual`): NxD key -> flatron key, or None
# with the reason it does nothing here
PRECISION_KEYS = {
    'parallel_layers_reduce_dtype': 'precision.parallel_layers_reduce_dtype',
    'fp32_grads_cc': None,
}
FP32_GRADS_CC = ('read by no code of NxD Training 2.26 either; data-parallel gradients reduce in the recipe\'s '
                 'accumulation dtype (precision.type)')
# Files that need a feature flatron does not have yet: feature -> (keys that ask for it, the
# value of each that does not); one line names it, instead of a table of unknown keys.
MISSING_FEATURES = {}      # none since MoE / EP and context parallelism were built


DOCUMENTED = (  # the keys of NxD Training's "YAML Configuration Settings" page and its example configs
    'name', 'model_source', 'seed', 'compiler_flags', 'compiler_cache_url', 'aync_exec_max_inflight_requests',
    'bucket_size_collectives', 'neuron_rt_exec_timeout', 'neuron_experimental_compress_rg',
    'trainer.devices', 'trainer.num_nodes', 'trainer.max_epochs', 'trainer.max_steps', 'trainer.log_every_n_steps',
    'trainer.val_check_interval', 'trainer.check_val_every_n_epoch', 'trainer.num_sanity_val_steps',
    'trainer.limit_val_batches', 'trainer.limit_test_batches', 'trainer.gradient_clip_val',
    'exp_manager.log_local_rank_0_only', 'exp_manager.create_tensorboard_logger', 'exp_manager.explicit_log_dir',
    'exp_manager.exp_log_dir', 'exp_manager.exp_dir', 'exp_manager.name', 'exp_manager.resume_if_exists',
    'exp_manager.resume_ignore_no_checkpoint', 'exp_manager.create_checkpoint_callback',
    'exp_manager.checkpoint_callback_params.monitor', 'exp_manager.checkpoint_callback_params.save_top_k',
    'exp_manager.checkpoint_callback_params.mode', 'exp_manager.checkpoint_callback_params.save_last',
    'exp_manager.checkpoint_callback_params.filename', 'exp_manager.checkpoint_callback_params.model_parallel_size',
    'exp_manager.checkpoint_callback_params.every_n_train_steps', 'exp_manager.log_parameter_norm',
    'exp_manager.log_gradient_norm', 'exp_manager.enable_recovery_time_instrumentation', 'exp_manager.save_xser',
    'exp_manager.load_xser', 'exp_manager.save_bf16', 'exp_manager.async_checkpointing',
    'exp_manager.resume_from_checkpoint', 'exp_manager.ckpt_ptl_version',
    'distributed_strategy.tensor_model_parallel_size', 'distributed_strategy.pipeline_model_parallel_size',
    'distributed_strategy.virtual_pipeline_model_parallel_size', 'distributed_strategy.zero1',
    'distributed_strategy.sequence_parallel', 'distributed_strategy.kv_replicator',
    'data.micro_batch_size', 'data.global_batch_size', 'data.data_prefix', 'data.index_mapping_dir', 'data.data_impl',
    'data.splits_string', 'data.seq_length', 'data.skip_warmup', 'data.num_workers', 'data.dataloader_type',
    'data.reset_position_ids', 'data.reset_attention_mask', 'data.eod_mask_loss', 'data.validation_drop_last',
    'data.no_seqlen_plus_one_input_tokens', 'data.pad_samples_to_global_batch_size', 'data.train_dir',
    'data.val_dir', 'data.dev_choose_samples', 'data.packing', 'data.use_sft_style_data_module',
    'data.tokenizer.library', 'data.tokenizer.type', 'data.tokenizer.model', 'data.tokenizer.vocab_file',
    'data.tokenizer.merge_file', 'data.tokenizer.delimiter', 'data.tokenizer.sentencepiece_legacy',
    'data.tokenizer.use_fast',
    'model.model_config', 'model.encoder_seq_length', 'model.max_position_embeddings', 'model.num_layers',
    'model.hidden_size', 'model.ffn_hidden_size', 'model.num_attention_heads', 'model.num_kv_heads',
    'model.kv_channels', 'model.init_method_std', 'model.use_scaled_init_method', 'model.hidden_dropout',
    'model.attention_dropout', 'model.ffn_dropout', 'model.apply_query_key_layer_scaling', 'model.normalization',
    'model.layernorm_epsilon', 'model.do_layer_norm_weight_decay', 'model.make_vocab_size_divisible_by',
    'model.persist_layer_norm', 'model.share_embeddings_and_output_weights', 'model.position_embedding_type',
    'model.rotary_percentage', 'model.activation', 'model.transformer_block_type', 'model.has_bias',
    'model.rope_theta', 'model.qkv_linear', 'model.fuse_qkv', 'model.use_cpu_initialization',
    'model.weight_init_only', 'model.activations_checkpoint_granularity', 'model.activations_checkpoint_recompute',
    'model.fusions.softmax', 'model.fusions.flash_attention', 'model.fusions.do_layer_norm_weight_decay',
    'model.optim.name', 'model.optim.lr', 'model.optim.weight_decay', 'model.optim.capturable', 'model.optim.betas',
    'model.optim.sched.name', 'model.optim.sched.warmup_steps', 'model.optim.sched.constant_steps',
    'model.optim.sched.min_lr', 'model.optim.sched.max_steps',
    'model_alignment_strategy.sft.packing', 'model_alignment_strategy.peft.lora_rank',
    'model_alignment_strategy.peft.lora_alpha', 'model_alignment_strategy.peft.lora_dropout',
    'model_alignment_strategy.peft.lora_bias', 'model_alignment_strategy.peft.lora_verbose',
    'model_alignment_strategy.peft.target_modules', 'model_alignment_strategy.peft.load_lora_from_ckpt',
    'model_alignment_strategy.peft.save_lora_base', 'model_alignment_strategy.peft.merge_lora',
    'model_alignment_strategy.peft.save_lora_config_adapter', 'model_alignment_strategy.peft.merge_sharded_lora',
    'precision.type', 'precision.master_weights', 'precision.fp32_grad_acc', 'precision.xla_use_bf16',
    'precision.xla_downcast_bf16', 'precision.neuron_rt_stochastic_rounding_en',
    # added by SDK 2.26's page and example configs
    'trainer.lnc', 'trainer.sequential_move_factor', 'exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt',
    'distributed_strategy.context_parallel_size', 'distributed_strategy.expert_model_parallel_size',
    'distributed_strategy.token_shuffle_group_size', 'model.transpose_nki_inputs', 'model.pipeline_cuts',
    'model.sliding_window_size', 'model.fusions.ring_attention',
    'model.moe.num_experts', 'model.moe.frequency', 'model.moe.dropout', 'model.moe.capacity_factor',
    'model.moe.sinkhorn_iterations', 'model.moe.sinkhorn_tol', 'model.moe.routing_algorithm', 'model.moe.top_k',
    'model.moe.output_router_logits', 'model.moe.router_aux_loss_coef', 'model.moe.normalize_top_k_affinities',
    'model.moe.router_activation', 'model.moe.dropless',
    'model_alignment_strategy.dpo.kl_beta', 'model_alignment_strategy.dpo.loss_type',
    'model_alignment_strategy.dpo.max_prompt_length', 'model_alignment_strategy.dpo.precompute_ref_log_probs',
    'model_alignment_strategy.dpo.truncation_mode', 'model_alignment_strategy.orpo.beta',
    'model_alignment_strategy.orpo.max_prompt_length', 'model_alignment_strategy.orpo.truncation_mode',
    'precision.parallel_layers_reduce_dtype', 'precision.fp32_grads_cc',
)
_TOKENIZER_NOTES = {
    'data.tokenizer.library': 'data.tokenizer.type (huggingface, sentencepiece; megatron = gpt2)',
    'data.tokenizer.type': 'data.tokenizer.model (HF: the directory\'s tokenizer.json)',
}


def missing_feature(key, value=None):
  """The feature of MISSING_FEATURES that `key` (at `value`; None: any) asks for, or None."""
  for feature, keys in MISSING_FEATURES.items():
    for name, off in keys:
      if (key.startswith(name) if name.endswith('.') else key == name) and (off is None or value != off):
        return feature
  return None


def lacks() -> str:
  """docs/nxd-migration.md's list of what a migrating user still lacks: each missing feature, its keys
  and the example files that need it."""
  return '\n'.join(f'- **{feature}**: ' + ', '.join(f'`{k}*`' if k.endswith('.') else f'`{k}`' for k, _ in keys)
                   for feature, keys in MISSING_FEATURES.items())


def describe(key):
  """(flatron key, note) for one NxD key: where it goes, or why it goes nowhere."""
  if key in _TOKENIZER_NOTES:
    return _TOKENIZER_NOTES[key], ''
  if missing_feature(key):
    return '—', f'not yet: {missing_feature(key)} (a file that sets it is refused in one line)'
  if key in ('precision.' + k for k in PRECISION_KEYS):
    target = PRECISION_KEYS[key.split('.', 1)[1]]
    return (target, 'every precision type') if target else ('—', 'not applicable: ' + FP32_GRADS_CC)
  if key.startswith('precision.') and key != 'precision.type':
    target = MANUAL_KNOBS[key.split('.', 1)[1]][0]
    return (f'precision.{target}' if target else '—'), MANUAL if target else 'not applicable: ' + XLA_DTYPE
  rule = RULES.get(key)
  if rule is None:
    return key, ''
  if rule.target:
    note = 'True: resume_from_checkpoint loads weights only' if key == 'model.weight_init_only' else ''
    return rule.target, note
  return '—', 'not applicable: ' + rule.reason


def table() -> str:
  """docs/nxd-migration.md's side-by-side table of every documented NxD key."""
  rows = ['| NxD Training key | flatron key | note |', '|---|---|---|']
  for key in DOCUMENTED:
    target, note = describe(key)
    rows.append(f'| `{key}` | {"`" + target + "`" if target != "—" else target} | {note} |')
  return '\n'.join(rows)
