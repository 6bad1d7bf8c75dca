"""The model section of the config: every key model/ reads, with its default and meaning.

configs/base.py builds its `model` section from `model_section()` (and adds `model.optim`, which
the optimizer reads); model/hf.py starts from it for the keys an HF config.json does not set. The
LoRA keys are NxD Training's `model_alignment_strategy.peft`: configs/base.py puts this same
object there, so `--config.model_alignment_strategy.peft.lora_rank=8` is what the model reads.
"""
from ml_collections import config_dict

placeholder = config_dict.placeholder


def model_section() -> config_dict.ConfigDict:
  model = config_dict.ConfigDict()
  model.architecture = 'llama'             # a label (model/checks.py ARCHITECTURES: llama, qwen3, phi3, ...): the keys below
                                           # decide the block; HF export names this family where the keys allow
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
  model.rope_scaling.type = 'none'         # none | linear | dynamic (NTK) | llama3 (Llama 3.1 / 3.2) | yarn (Qwen3) | longrope (Phi-3 / 4-mini)
  model.rope_scaling.factor = 1.0          # linear / dynamic / llama3 / yarn / longrope: how much longer than the original context
  model.rope_scaling.low_freq_factor = 1.0     # llama3: wavelengths above original / low_freq_factor are divided by factor
  model.rope_scaling.high_freq_factor = 4.0    # llama3: wavelengths below original / high_freq_factor are kept
  model.rope_scaling.original_max_position_embeddings = 8192  # llama3 / yarn / longrope: the context the model was pretrained at
  model.rope_scaling.beta_fast = 32.0      # yarn: dims turning more than this many times over the original context are kept
  model.rope_scaling.beta_slow = 1.0       # yarn: dims turning fewer than this many times are divided by factor (a ramp between)
  model.rope_scaling.truncate = True       # yarn: round the ramp's ends to whole dims (HF's default; False for gpt-oss)
  model.rope_scaling.mscale = 0.0          # yarn: set with mscale_all_dim, the attention factor is their mscales' ratio (DeepSeek); 0 = unset
  model.rope_scaling.mscale_all_dim = 0.0  # yarn: see mscale; 0 = unset
  model.rope_scaling.attention_factor = 0.0    # yarn / longrope: multiplies cos and sin; 0 = derived from factor as HF
  model.rope_scaling.short_factor = ()     # longrope: per-frequency divisors while positions stay within the original context
  model.rope_scaling.long_factor = ()      # longrope: per-frequency divisors once a position passes it
  model.rope_local_theta = 0.0             # RoPE base of sliding-window layers (Gemma 3: 1e4); 0 = rope_theta (and its scaling)
  model.sliding_window = 0                 # sliding_attention layers see the last this-many positions (Mistral, Gemma 3); 0 = off
  model.layer_types = ()                   # per layer: full_attention | sliding_attention | chunked_attention; () = all sliding if sliding_window, else all full
  model.attention_chunk_size = 0           # chunked_attention layers see the positions of their query's chunk of this many (Llama 4: 8192)
  model.normalization = 'rmsnorm'          # rmsnorm | layernorm
  model.layernorm_epsilon = 1e-5           # norm epsilon
  model.rmsnorm_unit_offset = False        # Gemma: RMSNorm scales by (1 + w), w starting at 0
  model.qk_norm = False                    # RMSNorm over the queries and keys before RoPE (Gemma 3, Qwen3, OLMo 2)
  model.qk_norm_span = 'head'              # head: over each head's dims (Gemma 3, Qwen3) | projection: over all of
                                           # q's heads and all of k's together (OLMo 2; under TP a sum over the group)
  model.sandwich_norm = False              # Gemma: attention and MLP outputs normed before the residual add
  model.post_norms_only = False            # OLMo 2: attention and MLP outputs normed before the residual add (HF's
                                           # post_attention_layernorm, post_feedforward_layernorm), their inputs not
  model.rmsnorm_scale_in_fp32 = False      # OLMo 2: RMSNorm multiplies by its weight in fp32, then casts (Llama casts first)
  model.nope_layers = ()                   # layers whose attention has no RoPE (SmolLM3: every 4th; HF no_rope_layers' zeros)
  model.attn_temperature_tuning = False    # Llama 4: NoPE layers' queries x log(floor((p + 1) / attn_floor_scale) + 1) x attn_scale + 1
  model.attn_floor_scale = 8192            # attn_temperature_tuning: positions per step of the temperature
  model.attn_scale = 0.1                   # attn_temperature_tuning: the temperature's slope
  model.rope_interleave = False            # Llama 4: each head's rotary dims stored in pairs (x0, x1)...; de-interleaved for RoPE
  model.qk_l2_norm = False                 # Llama 4: q and k scaled to unit RMS per head after RoPE (no weight; RoPE layers only)
  model.scale_embeddings = False           # Gemma: embeddings multiplied by sqrt(hidden_size)
  model.query_pre_attn_scalar = 0          # Gemma: scores scaled by 1/sqrt(this); 0 = head_dim
  model.activation = 'swiglu'              # swiglu | geglu (Gemma: tanh GELU gate) | gelu
  model.has_bias = False                   # biases in every linear layer (MoE: router and experts too, gpt-oss)
  model.qkv_bias = False                   # biases on q, k, v only (Qwen2)
  model.attention_sinks = False            # gpt-oss: a learned logit per head joins each query's softmax (its value 0)
  model.mla = mla = config_dict.ConfigDict()   # multi-head latent attention (DeepSeek-V2/V3; model/mla.py)
  mla.kv_lora_rank = 0                     # the keys' and values' shared latent width; 0 = MLA off
  mla.q_lora_rank = 0                      # the queries' bottleneck; 0 = one q_proj
  mla.qk_nope_head_dim = 128               # each head's query / key dims without RoPE
  mla.qk_rope_head_dim = 64                # ... with RoPE (the key's part shared by every head)
  mla.v_head_dim = 128                     # each head's value dims
  mla.rope_interleave = True               # the rotary dims stored in pairs (DeepSeek's files), de-interleaved for RoPE
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
  model.compile_backend = 'inductor'       # torch.compile's backend for model.compile: inductor, or one a PyTorch plug-in registers (a device's own compiler)
  model.moe = moe = config_dict.ConfigDict()   # mixture of experts (model/moe.py; NxD's keys + Qwen2-MoE's shared expert)
  moe.num_experts = 0                      # E experts per MoE layer; 0 = dense feed-forward everywhere
  moe.frequency = 1                        # layer i is MoE when (i + 1) % frequency == 0 (HF decoder_sparse_step)
  moe.dense_layers = ()                    # layers kept dense whatever the frequency (HF Qwen-MoE's mlp_only_layers)
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
  moe.shared_expert_intermediate_size = 0  # the always-on shared expert's width (Qwen2-MoE; DeepSeek: n_shared_experts x moe_intermediate_size); 0 = none
  moe.shared_expert_gate = True            # the shared expert scaled by sigmoid(gate x) (Qwen2-MoE); False: added as it is (DeepSeek)
  moe.num_groups = 1                       # experts in this many groups (DeepSeek's n_group): a token picks within ...
  moe.top_k_groups = 1                     # ... the top_k_groups groups whose two best scores sum highest
  moe.routed_scaling_factor = 1.0          # the routed experts' weights times this (DeepSeek-V3: 2.5)
  moe.scale_expert_input = False           # Llama 4: each token's input to an expert times its weight (its output unweighted)
  moe.load_balance_bias = False            # DeepSeek-V3's per-expert bias added to the scores to choose experts (not to weigh them)
  moe.load_balance_rate = 0.0              # after each step the bias moves this much toward balance (DeepSeek-V3: 0.001; optim/balancing.py); 0 = fixed
  moe.expert_activation = 'swiglu'        # swiglu | clamped_swiglu (gpt-oss: gate clamped above, up to +-limit, (up + 1) gate sigmoid(alpha gate))
  moe.swiglu_alpha = 1.702                 # clamped_swiglu: the sigmoid's gain
  moe.swiglu_limit = 7.0                   # clamped_swiglu: the clamp
  moe.fixed_buffers = False                # experts run in fixed-size buffers (static shapes) in eager runs too;
                                           # always under XLA and model.compile (model/moe.py)
  model.fusions = config_dict.ConfigDict()
  model.fusions.flash_attention = True     # F.scaled_dot_product_attention; False = explicit softmax path
  model.fusions.ring_attention = False     # attention of context parallelism: K/V blocks around the cp ranks (parallel/ring_attention.py)
  model.fusions.chunked_cross_entropy = 0  # LM head + loss over chunks of this many tokens (model/chunked_ce.py): one
                                           # chunk's logits at a time, not the micro batch's; 0 = off
  model.peft = peft = config_dict.ConfigDict()   # LoRA (model/lora.py); off while lora_rank = 0
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
  return model
