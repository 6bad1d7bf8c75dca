"""Every configuration key flatron knows, with its default and meaning.

Model configs start from `base.get_config()` and change what they need. Sections follow
NxD Training's YAML (`trainer`, `exp_manager`, `distributed_strategy`, `data`, `model`,
`precision`) so its users find keys where they expect them. Optional keys are typed
placeholders: `--config.data.tokenizer.model=/path/tok.model` works, a typo fails at parse
time. `configs/validate.py` checks the whole tree before anything is built.
"""
from ml_collections import config_dict

placeholder = config_dict.placeholder


def get_config(arg=None):
  del arg
  c = config_dict.ConfigDict()
  c.name = 'flatron'                 # run name: logs, TensorBoard (<workdir>/tensorboard/<name>), exp_manager.exp_dir/<name>
  c.seed = 1234                      # root of every keyed random draw (init, data, dropout)
  c.device = 'auto'                  # auto | cpu | cuda | xla  (auto: cuda if present, else cpu)
  c.model_source = 'megatron'        # megatron | hf: with hf the model section comes from model.model_config
  # NxD Training's compiler / runtime keys (parallel/xla.py maps them; reported at start-up where
  # they do nothing): neuronx-cc flags, a persistent compilation cache, Neuron runtime settings.
  c.compiler_flags = ''
  c.compiler_cache_url = ''
  c.aync_exec_max_inflight_requests = 0   # (sic: NxD's spelling)
  c.neuron_rt_exec_timeout = 0
  c.neuron_experimental_compress_rg = False
  c.keep_freed_host_memory = True     # CPU: glibc malloc keeps freed blocks for the next step instead of handing them back (parallel/device.py): steps stop faulting their activations in again; resident memory stays at its peak
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
  trainer.plan_cluster = 'auto'            # whose predicted step time the start-up summary prints (parallel/clusters.py: h100, trn1.32xlarge, local...); auto: local on CPU, by GPU name on CUDA, none on XLA; none = off

  c.exp_manager = config_dict.ConfigDict()
  exp_manager = c.exp_manager
  exp_manager.explicit_log_dir = placeholder(str)  # the run directory, used as it is (wins over exp_dir; --workdir may then be left out)
  exp_manager.exp_dir = placeholder(str)         # runs go to exp_dir/<exp_manager.name or name>; None = --workdir
  exp_manager.name = placeholder(str)            # the run's directory under exp_dir; None = the top-level name
  exp_manager.log_local_rank_0_only = True       # True: only global rank 0 prints; False: each host's local rank 0 too, as [rank N]
  exp_manager.create_tensorboard_logger = True   # TensorBoard events under <workdir>/tensorboard/<name>
  exp_manager.log_parameter_norm = True          # add param_norm to every logged step
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
  strategy.zero1_collectives = 'auto'         # auto | reduce_scatter | all_reduce: ZeRO-1's grad reduction + param gather (auto: fastest on the backend)
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

  c.model = config_dict.ConfigDict()
  model = c.model
  model.architecture = 'llama'             # llama | gpt | mistral | qwen2 | gemma3 (a label: the keys below decide the block;
                                           # HF export names this family where the keys allow)
  model.objective = 'next_token'           # what the loss is (model/objectives.py): next_token | dpo | orpo
  model.model_config = placeholder(str)    # model_source=hf: an HF config.json (or its directory); its
                                           # architecture keys replace the ones below at start-up
  model.model_config_overrides = ()        # model_source=hf: model keys kept as set here over config.json's (NxD: num_layers...)
  model.num_layers = 2                     # transformer blocks L
  model.hidden_size = 64                   # model width h
  model.ffn_hidden_size = 172              # MLP inner width f
  model.num_attention_heads = 4            # query heads a
  model.num_kv_heads = 0                   # key/value heads g (GQA); 0 = num_attention_heads
  model.head_dim = 0                       # per-head width; 0 = hidden_size / num_attention_heads
  model.vocab_size = 256                   # tokenizer vocabulary V (the embedding is padded, see below)
  model.make_vocab_size_divisible_by = 128  # pad V up to a multiple of this x TP (Megatron)
  model.max_position_embeddings = 128      # longest sequence (learned positions need it)
  model.position_embedding_type = 'rope'   # rope | learned_absolute
  model.rotary_percentage = 1.0            # fraction of each head's dims that RoPE rotates
  model.rope_theta = 10000.0               # RoPE base
  model.rope_scaling = config_dict.ConfigDict()   # RoPE frequency scaling for long context (HF's rope_scaling)
  model.rope_scaling.type = 'none'         # none | linear | dynamic (NTK, past max_position_embeddings) | llama3 (Llama 3.1 / 3.2)
  model.rope_scaling.factor = 1.0          # linear / dynamic / llama3: how much longer than the original context
  model.rope_scaling.low_freq_factor = 1.0     # llama3: wavelengths above original / low_freq_factor are divided by factor
  model.rope_scaling.high_freq_factor = 4.0    # llama3: wavelengths below original / high_freq_factor are kept
  model.rope_scaling.original_max_position_embeddings = 8192  # llama3: the context the model was pretrained at
  model.rope_local_theta = 0.0             # RoPE base of sliding-window layers (Gemma 3: 1e4); 0 = rope_theta (and its scaling)
  model.sliding_window = 0                 # sliding_attention layers see the last this-many positions (Mistral, Gemma 3); 0 = off
  model.layer_types = ()                   # per layer: full_attention | sliding_attention; () = all sliding if sliding_window, else all full
  model.normalization = 'rmsnorm'          # rmsnorm | layernorm
  model.layernorm_epsilon = 1e-5           # norm epsilon
  model.rmsnorm_unit_offset = False        # Gemma: RMSNorm scales by (1 + w), w starting at 0
  model.qk_norm = False                    # Gemma 3: RMSNorm over each query / key head before RoPE
  model.sandwich_norm = False              # Gemma: attention and MLP outputs normed before the residual add
  model.scale_embeddings = False           # Gemma: embeddings multiplied by sqrt(hidden_size)
  model.query_pre_attn_scalar = 0          # Gemma: scores scaled by 1/sqrt(this); 0 = head_dim
  model.activation = 'swiglu'              # swiglu | geglu (Gemma: tanh GELU gate) | gelu
  model.has_bias = False                   # biases in every linear layer
  model.qkv_bias = False                   # biases on q, k, v only (Qwen2)
  model.share_embeddings_and_output_weights = False  # tie the LM head to the input embedding
  model.hidden_dropout = 0.0               # dropout on attention / MLP outputs before the residual add
  model.attention_dropout = 0.0            # dropout on attention probabilities
  model.ffn_dropout = 0.0                  # dropout on the MLP's inner activation
  model.apply_query_key_layer_scaling = False  # Megatron: scale scores by 1/layer before fp32 softmax
  model.init_method_std = 0.02             # std of the normal init of weights and embeddings
  model.use_scaled_init_method = True      # output projections get std / sqrt(2 L)
  model.activations_checkpoint_granularity = placeholder(str)  # None | selective | full
  model.activations_checkpoint_recompute = ('attention',)      # selective: which parts to recompute (attention, mlp, norm, activation)
  model.compile = False                    # torch.compile each transformer block (one graph serves every layer; not with TP or XLA)
  model.moe = moe = config_dict.ConfigDict()   # mixture of experts (model/moe.py; NxD's keys + Qwen2-MoE's shared expert)
  moe.num_experts = 0                      # E experts per MoE layer; 0 = dense feed-forward everywhere
  moe.frequency = 1                        # layer i is MoE when (i + 1) % frequency == 0 (HF decoder_sparse_step)
  moe.top_k = 2                            # experts per token
  moe.routing_algorithm = 'top_k'          # top_k (sinkhorn is refused: not implemented)
  moe.router_activation = 'softmax'        # softmax | sigmoid: the router's affinities (top-k of them; the aux loss sums them)
  moe.normalize_top_k_affinities = True    # top-k weights renormalized to sum 1 (Mixtral; Qwen2-MoE's norm_topk_prob)
  moe.capacity_factor = 2.0                # dropless=False: each expert keeps ceil(cf * s * top_k / E) tokens per sequence
  moe.dropless = False                     # True: no token is ever dropped
  moe.output_router_logits = True          # add router_aux_loss_coef x the load-balancing loss (HF's) to the loss
  moe.router_aux_loss_coef = 0.02          # weight of the load-balancing loss
  moe.router_z_loss_coef = 0.0             # weight of the router z-loss (ST-MoE); 0 = off
  moe.dropout = 0.0                        # NxD's expert dropout: only 0 (refused otherwise)
  moe.sinkhorn_iterations = 30             # NxD's sinkhorn settings: read only with routing_algorithm=sinkhorn (refused)
  moe.sinkhorn_tol = placeholder(float)
  moe.ffn_hidden_size = 0                  # each expert's inner width; 0 = model.ffn_hidden_size (Qwen2-MoE: moe_intermediate_size)
  moe.shared_expert_intermediate_size = 0  # Qwen2-MoE's always-on shared expert (sigmoid-gated); 0 = none
  model.fusions = config_dict.ConfigDict()
  model.fusions.flash_attention = True     # F.scaled_dot_product_attention; False = explicit softmax path
  model.fusions.ring_attention = False     # attention of context parallelism: K/V blocks around the cp ranks (parallel/ring_attention.py)
  model.fusions.chunked_cross_entropy = 0  # LM head + loss over chunks of this many tokens (model/chunked_ce.py): one
                                           # chunk's logits at a time, not the micro batch's; 0 = off

  model.optim = config_dict.ConfigDict()
  optim = model.optim
  optim.name = 'adamw'                     # adamw | adamw_fp32OptState | adam | sgd | adadelta | adamax | adagrad | rmsprop | rprop | adafactor | novograd
  optim.lr = 3e-4                          # peak learning rate
  optim.weight_decay = 0.01                # decoupled (adamw) or L2 (others) decay; skips norms and biases
  optim.do_layer_norm_weight_decay = False  # also decay norm weights and biases
  optim.betas = (0.9, 0.95)                # Adam-family betas
  optim.eps = 1e-8                         # Adam-family epsilon
  optim.momentum = 0.0                     # sgd / rmsprop momentum
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
  c.model_alignment_strategy.peft = peft = config_dict.ConfigDict()   # LoRA (model/lora.py); off while lora_rank = 0
  peft.lora_rank = 0                      # r: adapter rank; 0 = no LoRA (full fine-tuning)
  # alpha, rsLoRA, dropout, bias and target_modules: None = unset, i.e. the loaded adapter's (load_lora_from_ckpt), else
  # the default in the comment; a value set here that differs from the loaded adapter's is an error.
  peft.lora_alpha = placeholder(float)    # scaling alpha / r (alpha / sqrt(r) with use_rslora); unset: 16
  peft.use_rslora = placeholder(bool)     # rank-stabilized scaling alpha / sqrt(r); unset: False
  peft.lora_dropout = placeholder(float)  # dropout on the adapter's input (keyed like every dropout); unset: 0
  peft.lora_bias = placeholder(str)       # none | all | lora_only: which biases train with the adapters (peft's `bias`); unset: none
  peft.target_modules = placeholder(object)  # unset: ('qkv_proj',). Among qkv_proj, o_proj, gate_up_proj, down_proj or peft's q/k/v/o/gate/up/down_proj (or all-linear); module paths ending in one; or one regular expression (a string) matched against model.layers.N.<...>.<proj>, as peft does
  peft.layers_to_transform = ()           # layer indices to adapt (peft's); () = all
  peft.rank_pattern = ()                  # ((pattern, r), ...): per-module ranks, peft's rank_pattern (the first pattern matching the end of the module path wins)
  peft.alpha_pattern = ()                 # ((pattern, alpha), ...): per-module alphas, peft's alpha_pattern
  peft.save_lora_base = False             # checkpoints also hold the frozen base (else adapters + their optimizer state only)
  peft.merge_lora = False                 # checkpoints hold the merged model W + scale B A (a full model; no adapters to resume)
  peft.load_lora_from_ckpt = False        # start the adapters from lora_save_dir/lora_load_tag (a flatron step or a peft dir)
  peft.lora_save_dir = placeholder(str)   # with load_lora_from_ckpt: where the adapter checkpoint is
  peft.lora_load_tag = placeholder(str)   # with load_lora_from_ckpt: its sub-directory (e.g. step_00000100), optional
  # The model reads its LoRA settings from its own section: model.peft *is* this section (one
  # object, so --config.model_alignment_strategy.peft.lora_rank=8 is seen by the model code).
  c.model.peft = peft

  c.precision = config_dict.ConfigDict()
  precision = c.precision
  precision.type = 'fp32'                      # fp32 | bf16SR | mixed_precision | mixed_precisionSR | autocast | manual
  precision.master_weights = False             # manual: fp32 master copy of bf16 params
  precision.fp32_grad_acc = False              # manual: accumulate grads in fp32
  precision.parameter_dtype = 'fp32'           # manual: fp32 | bf16
  precision.stochastic_rounding = False        # manual: round parameter updates stochastically
  precision.parallel_layers_reduce_dtype = placeholder(str)  # TP reductions: fp32 | bf16; None = the activations' dtype
  return c
