"""Every configuration key flatron knows, with its default and meaning.

Model configs start from `base.get_config()` and change what they need. Sections follow
NxD Training's YAML (`trainer`, `exp_manager`, `distributed_strategy`, `data`, `model`,
`precision`) so its users find keys where they expect them. Optional keys are typed
placeholders: `--config.data.tokenizer.model=/path/tok.model` works, a typo fails at parse
time. `configs/validate.py` checks the whole tree before anything is built. The `model` section's
keys (and the LoRA keys of `model_alignment_strategy.peft`) are defined beside the model, in
model/defaults.py, so model/ reads its defaults without importing configs/.
"""
from ml_collections import config_dict

from model import defaults

placeholder = config_dict.placeholder


def get_config(arg=None):
  del arg
  c = config_dict.ConfigDict()
  c.name = 'flatron'                 # run name: logs, TensorBoard (<workdir>/tensorboard/<name>), exp_manager.exp_dir/<name>
  c.seed = 1234                      # root of every keyed random draw (init, data, dropout)
  c.device = 'auto'                  # auto | cpu | cuda | xla | a plug-in's device type (neuron)  (auto: cuda if present, else a plug-in's accelerator, else cpu)
  c.backend = 'auto'                 # process-group backend: auto (the device's: gloo, nccl, xla, a plug-in's) | gloo | nccl | fake | ...
  c.model_source = 'megatron'        # megatron | hf: with hf the model section comes from model.model_config
  # NxD Training's compiler / runtime keys (parallel/xla.py maps them; reported at start-up where
  # they do nothing): neuronx-cc flags, a persistent compilation cache, Neuron runtime settings.
  c.compiler_flags = ''
  c.compiler_cache_url = ''
  c.aync_exec_max_inflight_requests = 0   # (sic: NxD's spelling)
  c.neuron_rt_exec_timeout = 0
  c.neuron_experimental_compress_rg = False
  c.keep_freed_host_memory = True     # CPU: glibc malloc keeps freed blocks for the next step instead of handing them back (parallel/device.py): steps stop faulting their activations in again; resident memory stays at its peak
  c.trim_host_heap = config_dict.FieldReference('auto', field_type=object)  # CPU, with keep_freed_host_memory: auto | True | False. True: once a rank's resident memory comes within one copy of the head's logits of its start-up estimate, the heap's free pages go back (malloc_trim, checked before each layer's forward and backward, the head and the loss; costs page faults), the estimate counting 0.4x the step's transient for the heap's holes; False: never, the estimate counting 1.6x; auto: True only where memory is short (the untrimmed estimate past 90% of what a rank has: available RAM or the cgroup's limit, over the host's ranks), else False
  c.bucket_size_collectives = 32.0   # MiB: DP gradient all-reduce and ZeRO-1's collectives go through flat buffers of this size

  c.trainer = config_dict.ConfigDict()
  trainer = c.trainer
  trainer.max_steps = 100                  # optimizer steps to train (also the LR schedule length)
  trainer.max_epochs = -1                  # N > 0: also stop after N passes over the train split (whichever first); -1 = max_steps alone
  trainer.log_every_n_steps = 1            # print + metrics.jsonl every N steps
  trainer.val_check_interval = 50          # validate every N steps; 0 disables
  trainer.check_val_every_n_epoch = placeholder(int)  # also validate on the step completing every N-th epoch; None = off
  trainer.limit_val_batches = 2            # global batches per validation
  trainer.num_sanity_val_steps = 0         # global validation batches run once before training
  trainer.limit_test_batches = 0           # after training, global batches of the test split to evaluate (test_loss); 0 = none
  trainer.gradient_clip_val = 1.0          # clip the global grad norm to this; 0 disables
  trainer.exit_interval = 0                 # Megatron's: checkpoint and exit after a step divisible by N (0 = off)
  trainer.nonfinite_policy = 'error'       # error | skip: on a NaN/inf loss or grad norm, stop or skip the update
  trainer.max_consecutive_skips = 10       # skip: stop with an error after this many skipped steps in a row
  trainer.memory_check = True              # refuse at start-up when the memory estimate exceeds the rank's memory
  trainer.plan_cluster = 'auto'            # whose predicted step time the start-up summary prints (estimates/clusters.py: h100, trn1.32xlarge, local...); auto: local on CPU, by GPU name on CUDA, none on XLA; none = off

  c.exp_manager = config_dict.ConfigDict()
  exp_manager = c.exp_manager
  exp_manager.explicit_log_dir = placeholder(str)  # the run directory, used as it is (wins over exp_dir; --workdir may then be left out)
  exp_manager.exp_dir = placeholder(str)         # runs go to exp_dir/<exp_manager.name or name>; None = --workdir
  exp_manager.name = placeholder(str)            # the run's directory under exp_dir; None = the top-level name
  exp_manager.log_local_rank_0_only = True       # True: only global rank 0 prints; False: each host's local rank 0 too, as [rank N]
  exp_manager.create_tensorboard_logger = True   # TensorBoard events under <workdir>/tensorboard/<name>
  exp_manager.log_parameter_norm = True          # add param_norm to every logged step
  exp_manager.log_layer_stats = False            # logged steps also get grad / param norms per layer and group, MoE load per layer (parallel/layer_stats.py)
  # Experiment trackers beside TensorBoard (monitor/trackers.py; NxD's / NeMo's keys): each gets
  # every record metrics.jsonl gets, and the config once. Optional packages: pip install wandb / mlflow
  exp_manager.create_wandb_logger = False
  exp_manager.wandb_logger_kwargs = config_dict.ConfigDict(dict(
      project=placeholder(str), name=placeholder(str), entity=placeholder(str), group=placeholder(str),
      tags=placeholder(tuple), notes=placeholder(str), job_type=placeholder(str),
      id=placeholder(str),                      # continue this W&B run (a resumed run continues its own)
      offline=placeholder(bool),                # None: offline when WANDB_MODE=offline or the server does not answer
      save_dir=placeholder(str)))               # where wandb/ goes; None: the workdir
  exp_manager.create_mlflow_logger = False
  exp_manager.mlflow_logger_kwargs = config_dict.ConfigDict(dict(
      experiment_name=placeholder(str),         # None: the run's name
      run_name=placeholder(str), tags=placeholder(dict), artifact_location=placeholder(str),
      run_id=placeholder(str),                  # continue this MLflow run (a resumed run continues its own)
      tracking_uri=placeholder(str),            # None: MLFLOW_TRACKING_URI, else a file store in save_dir
      save_dir=placeholder(str)))               # the file store; None: <workdir>/mlruns
  exp_manager.create_checkpoint_callback = False  # save checkpoints (every_n_train_steps, at the end, on SIGTERM)
  exp_manager.checkpoint_dir = placeholder(str)   # where steps go; default <workdir>/checkpoints; s3://, gs:// work
  exp_manager.init_from = placeholder(str)        # weights only, when not resuming: a flatron checkpoint step or an HF Llama dir
  exp_manager.resume_if_exists = False           # resume from the newest committed checkpoint in workdir
  exp_manager.resume_ignore_no_checkpoint = False  # with resume_if_exists: start fresh when none exists (else an error)
  exp_manager.resume_from_checkpoint = placeholder(str)  # explicit checkpoint path to resume from
  exp_manager.async_checkpointing = False        # write checkpoints in a background thread
  exp_manager.checkpoint_callback_params = config_dict.ConfigDict()
  exp_manager.checkpoint_callback_params.save_top_k = 2           # keep the K best committed steps by monitor (-1 = all)
  exp_manager.checkpoint_callback_params.every_n_train_steps = 0  # save every N steps; 0 = only at the end
  exp_manager.checkpoint_callback_params.monitor = 'step'         # what save_top_k ranks by: step | val_loss | val_<metric> (validated before every save)
  exp_manager.checkpoint_callback_params.mode = 'max'             # max | min: which values of monitor are best (step + max = the newest K)
  exp_manager.checkpoint_callback_params.save_last = True         # keep the newest step whatever its rank (False: still kept under resume_if_exists)
  exp_manager.checkpoint_callback_params.filename = placeholder(str)  # step directory template with {step} (and {consumed_samples}); None = step_00000100

  c.distributed_strategy = config_dict.ConfigDict()
  strategy = c.distributed_strategy
  strategy.tensor_model_parallel_size = 1     # TP degree t (ranks sharing each layer); heads, ffn, vocab divide by t
  strategy.pipeline_model_parallel_size = 1   # PP degree p (stages of contiguous layers)
  strategy.virtual_pipeline_model_parallel_size = 1  # interleaved chunks v per PP rank (1 = plain 1F1B)
  strategy.deallocate_pipeline_outputs = False  # free a stage's output once sent (its autograd node stays)
  strategy.pipeline_cuts = ()                 # explicit stage boundaries as layer indices; () = even split
  strategy.sequence_parallel = False          # shard norms/dropout over the sequence inside TP groups (needs t > 1)
  strategy.zero1 = False                      # shard optimizer state + fp32 master weights over DP
  strategy.zero_stage = 1                     # with zero1: 1 shards optimizer state + masters, 2 also the gradients, 3 also the parameters
  strategy.data_parallel_shard_size = 0       # HSDP: ZeRO shards over groups of this many dp x cp ranks, replicated across the groups (0: one group of all)
  strategy.grad_reduce_per_micro_batch = True  # ZeRO-2/3: reduce-scatter each micro batch's gradients, keep 1/dp (False, ZeRO-3: whole buckets through the step, one reduce-scatter)
  strategy.reshard_after_backward = True      # ZeRO-3: free the layers after each backward pass (False: keep them through the step's micro batches)
  strategy.reshard_after_forward = True       # ZeRO-3: free each layer's gathered parameters after its forward (False: keep them until its backward)
  strategy.zero1_collectives = 'auto'         # auto (= reduce_scatter) | reduce_scatter | all_reduce: ZeRO-1's grad reduction + param gather
  strategy.overlap_grad_reduce = True         # start each gradient bucket's DP reduction during the backward (bitwise the same results)
  strategy.overlap_param_gather = True        # ZeRO-1: leave the updated parameters' gathers in flight; the next forward waits for each layer's (bitwise the same results)
  strategy.expert_model_parallel_size = 1    # EP degree e: MoE experts sharded over e ranks carved from data parallel (Megatron)
  strategy.kv_replicator = 1                  # copies of each KV head when t > num_kv_heads (t = kv_heads * kv_replicator)
  strategy.context_parallel_size = 1          # CP degree c: each rank holds 1/c of every sequence (2c chunks, rank i has i and 2c-1-i); needs model.fusions.ring_attention
  strategy.collective_timeout_s = 300         # a collective that waits longer fails, naming rank and op

  c.data = config_dict.ConfigDict()
  data = c.data
  data.micro_batch_size = 1               # sequences per forward/backward on one rank
  data.global_batch_size = 8              # sequences per optimizer step over all DP ranks
  data.seq_length = 128                   # tokens per sequence (the model sees seq_length, predicts the next)
  data.data_prefix = ()                   # () = synthetic stream; else (w1, prefix1, w2, prefix2, ...) of .bin/.idx
  data.source = 'auto'                    # where samples come from (data/sources.py): auto | synthetic | indexed | sft | preference | text | a name a fork registers; auto: preference pairs when model.objective is dpo/orpo, SFT records when train_dir is set, the indexed corpus when data_prefix is, text when text.train is, else synthetic
  data.text = config_dict.ConfigDict()    # data.source=text: .jsonl / .parquet documents tokenized as they are read (data/text.py)
  data.text.train = ()                    # paths or globs of .jsonl / .parquet files, one stream in this order, repeating after the last
  data.text.valid = ()                    # the validation split's files (starts at its first document each validation)
  data.text.test = ()                     # the test split's files (trainer.limit_test_batches)
  data.text.key = 'text'                  # the JSON field / parquet column holding each document's text
  data.splits_string = '980,10,10'        # train,valid,test proportions of documents
  data.index_mapping_dir = placeholder(str)  # where sample-index caches go; default: beside the data
  data.eod_mask_loss = False              # Megatron: no loss where the input token is end-of-document
  data.reset_position_ids = False         # restart positions at each document inside a sample
  data.reset_attention_mask = False       # attend only within the current document inside a sample
  data.synthetic_vocab_size = 0           # tokens of the synthetic stream; 0 = the model's vocab_size
  data.train_dir = placeholder(str)       # SFT: records (.jsonl/.json/.arrow, a directory of them, or save_to_disk)
  data.val_dir = placeholder(str)         # SFT: validation records, same formats
  data.test_dir = placeholder(str)        # SFT: test records (trainer.limit_test_batches), same formats
  data.dev_choose_samples = placeholder(int)  # SFT: use only the first N records of each split
  data.tokenizer = config_dict.ConfigDict()
  data.tokenizer.type = 'none'            # none | sentencepiece | huggingface | gpt2
  data.tokenizer.model = placeholder(str)       # .model (sentencepiece) or tokenizer.json (huggingface)
  data.tokenizer.vocab_file = placeholder(str)  # gpt2: vocab.json or encoder.json
  data.tokenizer.merge_file = placeholder(str)  # gpt2: merges.txt or vocab.bpe

  c.model = model = defaults.model_section()   # the model's keys, with their meaning: model/defaults.py

  model.optim = config_dict.ConfigDict()
  optim = model.optim
  optim.name = 'adamw'                     # adamw | adamw_fp32OptState | adam | sgd | adadelta | adamax | adagrad | rmsprop | rprop | adafactor | novograd | muon | lion
  optim.lr = 3e-4                          # peak learning rate
  optim.weight_decay = 0.01                # decoupled (adamw) or L2 (others) decay; skips norms and biases
  optim.do_layer_norm_weight_decay = False  # also decay norm weights and biases
  optim.betas = (0.9, 0.95)                # Adam-family betas
  optim.eps = 1e-8                         # Adam-family epsilon
  optim.momentum = 0.0                     # sgd / rmsprop momentum
  optim.muon = config_dict.ConfigDict(dict(  # name=muon: the layers' matrices (AdamW for the rest: optim/muon.py)
      momentum=0.95, nesterov=True,
      ns_steps=5,                          # Newton-Schulz iterations
      ns_dtype='bfloat16',                 # bfloat16 (torch.optim.Muon's) | float32
      adjust_lr='match_rms_adamw'))        # the lr scale by shape: match_rms_adamw (Moonlight: 0.2 sqrt(max(A, B))) | original
  optim.sched = config_dict.ConfigDict()
  sched = optim.sched
  sched.name = 'CosineAnnealing'           # see optim/schedules.py for the list
  sched.warmup_steps = 10                  # linear warm-up steps from 0 to lr
  sched.warmup_ratio = placeholder(float)  # alternative to warmup_steps: fraction of max_steps
  sched.constant_steps = 0                 # CosineAnnealing: steps held at min_lr after the decay (NeMo)
  sched.hold_steps = 0                     # WarmupHoldPolicy: steps held at lr after warm-up
  sched.min_lr = 3e-5                      # floor reached at the end of the decay
  sched.max_steps = placeholder(int)       # schedule length; default trainer.max_steps
  sched.power = 1.0                        # polynomial power (PolynomialDecayAnnealing-style), SquareAnnealing uses 2
  sched.d_model = placeholder(int)         # NoamAnnealing: model width; default model.hidden_size
  sched.step_size = 100                    # StepLR: decay every N steps
  sched.gamma = 0.1                        # StepLR / ExponentialLR: decay factor

  c.model_alignment_strategy = config_dict.ConfigDict()
  c.model_alignment_strategy.sft = config_dict.ConfigDict()
  c.model_alignment_strategy.sft.packing = True   # several examples per row, each attending only to itself
  c.model_alignment_strategy.dpo = dpo = config_dict.ConfigDict()   # model.objective=dpo: preference pairs (data/preference.py)
  dpo.kl_beta = 0.1                       # beta: strength of the KL penalty toward the reference model
  dpo.loss_type = 'sigmoid'               # sigmoid | ipo: DPO's logistic loss or IPO's squared loss
  dpo.label_smoothing = 0.0               # sigmoid: assumed probability that a pair's preference is flipped (cDPO)
  dpo.max_prompt_length = 64              # a pair that does not fit a row has its prompt cut to this many tokens first
  dpo.precompute_ref_log_probs = False    # compute the reference log-probs once, before training
  dpo.truncation_mode = 'keep_end'        # keep_end | keep_start: which end of a cut prompt is kept (trl's)
  dpo.reference_model = 'start'           # start: the starting model (with LoRA: base + the starting adapter, as trl) | base: with LoRA, the base with adapters off
  c.model_alignment_strategy.orpo = orpo = config_dict.ConfigDict()  # model.objective=orpo: preference pairs, no reference model
  orpo.beta = 0.1                         # lambda: weight of the odds-ratio term beside the chosen NLL
  orpo.nll_reduction = 'pair'             # pair: mean over pairs of each chosen response's mean token NLL (NxD Training, the paper) | token: mean over the global batch's chosen tokens (trl)
  orpo.max_prompt_length = 64             # a pair that does not fit a row has its prompt cut to this many tokens first
  orpo.truncation_mode = 'keep_end'       # keep_end | keep_start: which end of a cut prompt is kept (trl's)
  c.model_alignment_strategy.peft = c.model.peft   # LoRA (model/lora.py): one object, keys in model/defaults.py

  c.precision = config_dict.ConfigDict()
  precision = c.precision
  precision.type = 'fp32'                      # fp32 | bf16SR | mixed_precision | mixed_precisionSR | autocast | manual
  precision.master_weights = False             # manual: fp32 master copy of bf16 params
  precision.fp32_grad_acc = False              # manual: accumulate grads in fp32
  precision.parameter_dtype = 'fp32'           # manual: fp32 | bf16
  precision.stochastic_rounding = False        # manual: round parameter updates stochastically
  precision.parallel_layers_reduce_dtype = placeholder(str)  # TP reductions: fp32 | bf16; None = the activations' dtype
  precision.fp8 = placeholder(str)             # tensorwise | rowwise: the transformer's linears in float8 (None: off)

  c.profiling = config_dict.ConfigDict()      # torch.profiler over a window of steps (monitor/profiling.py)
  profiling = c.profiling
  profiling.start_step = 0                     # the window's first step (counted from 1); 0 = off
  profiling.num_steps = 2                      # steps in the window
  profiling.ranks = (0,)                       # global ranks that record; () = every rank
  profiling.record_shapes = False              # operator input shapes
  profiling.profile_memory = False             # tensor allocations and frees
  profiling.with_stack = False                 # Python stacks of each operator
  profiling.cuda_memory_snapshot = False       # CUDA: the allocator's history over the window, its snapshot at the end
  profiling.snapshot_entries = 100000          # allocator events the snapshot keeps
  return c
