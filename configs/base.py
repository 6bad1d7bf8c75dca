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
  c.name = 'flatron'                 # run name, shown in logs and TensorBoard
  c.seed = 1234                      # root of every keyed random draw (init, data, dropout)
  c.device = 'auto'                  # auto | cpu | cuda | xla  (auto: cuda if present, else cpu)

  c.trainer = config_dict.ConfigDict()
  t = c.trainer
  t.max_steps = 100                  # optimizer steps to train (also the LR schedule length)
  t.log_every_n_steps = 1            # print + metrics.jsonl every N steps
  t.val_check_interval = 50          # validate every N steps; 0 disables
  t.limit_val_batches = 2            # global batches per validation
  t.num_sanity_val_steps = 0         # global validation batches run once before training
  t.gradient_clip_val = 1.0          # clip the global grad norm to this; 0 disables
  t.exit_interval = 0                 # Megatron's: checkpoint and exit after a step divisible by N (0 = off)
  t.nonfinite_policy = 'error'       # error | skip: on a NaN/inf loss or grad norm, stop or skip the update
  t.max_consecutive_skips = 10       # skip: stop with an error after this many skipped steps in a row
  t.memory_check = True              # refuse at start-up when the memory estimate exceeds the rank's memory

  c.exp_manager = config_dict.ConfigDict()
  e = c.exp_manager
  e.create_tensorboard_logger = True   # TensorBoard events under <workdir>/tensorboard
  e.log_parameter_norm = True          # add param_norm to every logged step
  e.create_checkpoint_callback = False  # save checkpoints (every_n_train_steps, at the end, on SIGTERM)
  e.checkpoint_dir = placeholder(str)   # where steps go; default <workdir>/checkpoints; s3://, gs:// work
  e.init_from = placeholder(str)        # weights only, when not resuming: a flatron checkpoint step or an HF Llama dir
  e.resume_if_exists = False           # resume from the newest committed checkpoint in workdir
  e.resume_ignore_no_checkpoint = False  # with resume_if_exists: start fresh when none exists (else an error)
  e.resume_from_checkpoint = placeholder(str)  # explicit checkpoint path to resume from
  e.async_checkpointing = False        # write checkpoints in a background thread
  e.checkpoint_callback_params = config_dict.ConfigDict()
  e.checkpoint_callback_params.save_top_k = 2           # keep the last K committed steps
  e.checkpoint_callback_params.every_n_train_steps = 0  # save every N steps; 0 = only at the end

  c.distributed_strategy = config_dict.ConfigDict()
  d = c.distributed_strategy
  d.tensor_model_parallel_size = 1     # TP degree t (ranks sharing each layer); heads, ffn, vocab divide by t
  d.pipeline_model_parallel_size = 1   # PP degree p (stages of contiguous layers)
  d.virtual_pipeline_model_parallel_size = 1  # interleaved chunks v per PP rank (1 = plain 1F1B)
  d.pipeline_cuts = ()                 # explicit stage boundaries as layer indices; () = even split
  d.sequence_parallel = False          # shard norms/dropout over the sequence inside TP groups (needs t > 1)
  d.zero1 = False                      # shard optimizer state + fp32 master weights over DP
  d.kv_replicator = 1                  # copies of each KV head when t > num_kv_heads (t = kv_heads * kv_replicator)
  d.collective_timeout_s = 300         # a collective that waits longer fails, naming rank and op

  c.data = config_dict.ConfigDict()
  a = c.data
  a.micro_batch_size = 1               # sequences per forward/backward on one rank
  a.global_batch_size = 8              # sequences per optimizer step over all DP ranks
  a.seq_length = 128                   # tokens per sequence (the model sees seq_length, predicts the next)
  a.data_prefix = ()                   # () = synthetic stream; else (w1, prefix1, w2, prefix2, ...) of .bin/.idx
  a.splits_string = '980,10,10'        # train,valid,test proportions of documents
  a.index_mapping_dir = placeholder(str)  # where sample-index caches go; default: beside the data
  a.eod_mask_loss = False              # Megatron: no loss where the input token is end-of-document
  a.reset_position_ids = False         # restart positions at each document inside a sample
  a.reset_attention_mask = False       # attend only within the current document inside a sample
  a.synthetic_vocab_size = 0           # tokens of the synthetic stream; 0 = the model's vocab_size
  a.tokenizer = config_dict.ConfigDict()
  a.tokenizer.type = 'none'            # none | sentencepiece | huggingface | gpt2
  a.tokenizer.model = placeholder(str)       # .model (sentencepiece) or tokenizer.json (huggingface)
  a.tokenizer.vocab_file = placeholder(str)  # gpt2: vocab.json or encoder.json
  a.tokenizer.merge_file = placeholder(str)  # gpt2: merges.txt or vocab.bpe

  c.model = config_dict.ConfigDict()
  m = c.model
  m.architecture = 'llama'             # llama | gpt (a label; the keys below decide the block)
  m.num_layers = 2                     # transformer blocks L
  m.hidden_size = 64                   # model width h
  m.ffn_hidden_size = 172              # MLP inner width f
  m.num_attention_heads = 4            # query heads a
  m.num_kv_heads = 0                   # key/value heads g (GQA); 0 = num_attention_heads
  m.head_dim = 0                       # per-head width; 0 = hidden_size / num_attention_heads
  m.vocab_size = 256                   # tokenizer vocabulary V (the embedding is padded, see below)
  m.make_vocab_size_divisible_by = 128  # pad V up to a multiple of this x TP (Megatron)
  m.max_position_embeddings = 128      # longest sequence (learned positions need it)
  m.position_embedding_type = 'rope'   # rope | learned_absolute
  m.rotary_percentage = 1.0            # fraction of each head's dims that RoPE rotates
  m.rope_theta = 10000.0               # RoPE base
  m.normalization = 'rmsnorm'          # rmsnorm | layernorm
  m.layernorm_epsilon = 1e-5           # norm epsilon
  m.activation = 'swiglu'              # swiglu | gelu
  m.has_bias = False                   # biases in every linear layer
  m.share_embeddings_and_output_weights = False  # tie the LM head to the input embedding
  m.hidden_dropout = 0.0               # dropout on attention / MLP outputs before the residual add
  m.attention_dropout = 0.0            # dropout on attention probabilities
  m.ffn_dropout = 0.0                  # dropout on the MLP's inner activation
  m.apply_query_key_layer_scaling = False  # Megatron: scale scores by 1/layer before fp32 softmax
  m.init_method_std = 0.02             # std of the normal init of weights and embeddings
  m.use_scaled_init_method = True      # output projections get std / sqrt(2 L)
  m.activations_checkpoint_granularity = placeholder(str)  # None | selective | full
  m.activations_checkpoint_recompute = ('attention',)      # selective: which parts to recompute (attention, mlp)
  m.fusions = config_dict.ConfigDict()
  m.fusions.flash_attention = True     # F.scaled_dot_product_attention; False = explicit softmax path

  m.optim = config_dict.ConfigDict()
  o = m.optim
  o.name = 'adamw'                     # adamw | adamw_fp32OptState | adam | sgd | adadelta | adamax | adagrad | rmsprop | rprop | adafactor | novograd
  o.lr = 3e-4                          # peak learning rate
  o.weight_decay = 0.01                # decoupled (adamw) or L2 (others) decay; skips norms and biases
  o.do_layer_norm_weight_decay = False  # also decay norm weights and biases
  o.betas = (0.9, 0.95)                # Adam-family betas
  o.eps = 1e-8                         # Adam-family epsilon
  o.momentum = 0.0                     # sgd / rmsprop momentum
  o.sched = config_dict.ConfigDict()
  s = o.sched
  s.name = 'CosineAnnealing'           # see optim/schedules.py for the list
  s.warmup_steps = 10                  # linear warm-up steps from 0 to lr
  s.warmup_ratio = placeholder(float)  # alternative to warmup_steps: fraction of max_steps
  s.constant_steps = 0                 # CosineAnnealing: steps held at min_lr after the decay (NeMo)
  s.hold_steps = 0                     # WarmupHoldPolicy: steps held at lr after warm-up
  s.min_lr = 3e-5                      # floor reached at the end of the decay
  s.max_steps = placeholder(int)       # schedule length; default trainer.max_steps
  s.power = 1.0                        # polynomial power (PolynomialDecayAnnealing-style), SquareAnnealing uses 2
  s.d_model = placeholder(int)         # NoamAnnealing: model width; default model.hidden_size
  s.step_size = 100                    # StepLR: decay every N steps
  s.gamma = 0.1                        # StepLR / ExponentialLR: decay factor

  c.precision = config_dict.ConfigDict()
  p = c.precision
  p.type = 'fp32'                      # fp32 | bf16SR | mixed_precision | mixed_precisionSR | autocast | manual
  p.master_weights = False             # manual: fp32 master copy of bf16 params
  p.fp32_grad_acc = False              # manual: accumulate grads in fp32
  p.parameter_dtype = 'fp32'           # manual: fp32 | bf16
  p.stochastic_rounding = False        # manual: round parameter updates stochastically
  return c
