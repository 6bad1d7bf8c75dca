"""Shared machinery of the layout-parity tests: train a tiny config on N spawned ranks and
compare losses, grad norms and the assembled global parameters with the single-device run."""
import json
import os

import numpy as np
import torch

import train
from configs import llama_tiny
from data.loader import Loader
from optim import update
from parallel import mesh as meshes, param_shards, tensor, training
from tests import world

STEPS = 10


def roundoff(n_terms, scale=1.0, dtype=torch.float32, slack=4.0):
  """How far apart two float computations of one value may land when they take its terms in
  different orders (another algorithm, another CPU's vector width, another thread count), as an
  absolute tolerance: a sum of n terms added in any order is within (n - 1)·u·Σ|x| of the exact
  sum (u = eps / 2; Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §4.2), so two
  orders are within n·eps·Σ|x| of each other. `n_terms`: the additions along the longest chain
  (nested sums add up: a log-softmax over V logits, then a sum over T tokens: V + T); `scale`:
  Σ|x|, the result's magnitude where the terms share its sign, the operands' magnitudes added
  where a difference cancels (1: a relative tolerance); `slack`: the few rounded operations
  (exp, log, division) that feed each term."""
  return slack * n_terms * torch.finfo(dtype).eps * scale


def assert_close_roundoff(actual, expected, n_terms, slack=4.0, msg=None):
  """torch.testing.assert_close within `roundoff` of `n_terms`-term sums in `actual`'s precision:
  relative to each element, and absolute at the scale of `expected`'s largest element (an element
  near zero is a sum whose terms cancel; they are taken as no larger than the largest result)."""
  dtype = actual.dtype if actual.is_floating_point() else torch.float32
  scale = expected.detach().abs().max().item() if expected.numel() else 0.0
  torch.testing.assert_close(actual, expected, rtol=roundoff(n_terms, dtype=dtype, slack=slack),
                             atol=roundoff(n_terms, scale=scale, dtype=dtype, slack=slack), msg=msg)


def parity_config(tp=1, sp=False, kv_replicator=1, dropout=0.0, pp=1, vp=1, cuts=(), layers=2,
                  tied=False, micro=2, zero1=False, precision='fp32', sft=None, lora=0, lora_dropout=0.0,
                  objective='next_token', precompute=False, qkv_bias=False, rope_llama3=False,
                  family=None, moe=0, ep=1, capacity=1.0, aux=True, cp=1, attention_dropout=None,
                  nll_reduction='pair', fixed_buffers=False, fp8=None, steps=STEPS, compile_blocks=False,
                  lr=None, zero_stage=1, shard=0, recompute=None, reshard=True, per_micro_batch=True,
                  reshard_backward=True, balance_rate=0.0, optim=None):
  c = llama_tiny.get_config('test')
  c.data.train_dir = c.data.val_dir = sft     # SFT records (packed rows, masked prompts)
  c.trainer.max_steps = steps
  c.trainer.val_check_interval = 0
  c.trainer.gradient_clip_val = 0.3          # below the early grad norms: clipping is active
  c.exp_manager.create_tensorboard_logger = False
  c.data.global_batch_size, c.data.micro_batch_size = 8, micro  # accumulation at every DP degree
  c.model.num_layers = layers
  c.model.share_embeddings_and_output_weights = tied
  c.model.hidden_dropout = c.model.ffn_dropout = dropout
  c.model.attention_dropout = dropout if attention_dropout is None else attention_dropout   # (cp refuses it)
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.sequence_parallel, d.kv_replicator = tp, sp, kv_replicator
  d.pipeline_model_parallel_size, d.virtual_pipeline_model_parallel_size = pp, vp
  d.pipeline_cuts = tuple(cuts)
  d.zero1, d.zero_stage = zero1, zero_stage   # ZeRO's stage: 2 shards the gradients too, 3 the parameters
  d.data_parallel_shard_size = shard          # HSDP: ZeRO's shard groups of this many ranks, replicated
  d.reshard_after_forward = reshard           # ZeRO-3: False keeps each layer's gathered parameters until its backward
  d.grad_reduce_per_micro_batch = per_micro_batch   # ZeRO-3: False reduces whole gradients once per step
  d.reshard_after_backward = reshard_backward  # ZeRO-3: False keeps the gathered layers through the step's micro batches
  c.model.activations_checkpoint_granularity = recompute   # 'full' or 'selective' (tests/test_remat.py)
  d.context_parallel_size = cp               # context parallelism: the ring over cp ranks
  c.model.fusions.ring_attention = cp > 1
  c.precision.type = precision
  c.precision.fp8 = fp8                      # numerics/fp8.py's recipe for the linears
  c.model.qkv_bias = qkv_bias                # Qwen2's biases on q, k, v only
  c.model.compile = compile_blocks           # compiled blocks (parallel/compiled.py): the reference is eager
  c.model.optim.lr = lr or c.model.optim.lr
  if rope_llama3:                            # Llama 3.1's RoPE scaling
    c.model.rope_scaling.update(dict(type='llama3', factor=8.0, original_max_position_embeddings=8))
  if family:                                 # model/hf.py's families' blocks (tests/test_hf.py checks them vs HF)
    apply_family(c.model, family)
  c.model.moe.load_balance_rate = balance_rate   # DeepSeek-V3's correction biases moved by the loads (optim/balancing.py)
  if optim:                                  # another optimizer (Muon's iteration in fp32: layouts agree to its round-off)
    c.model.optim.name, c.model.optim.muon.ns_dtype = optim, 'float32'
  d.collective_timeout_s = 120
  d.expert_model_parallel_size = ep          # over `moe`'s experts, or a family's own (qwen3_moe)
  if moe:          # MoE (model/moe.py): `moe` experts, top-2, dropping at `capacity` (0: dropless), aux losses
    c.model.moe.update(num_experts=moe, top_k=2, capacity_factor=capacity or 1.0, dropless=not capacity,
                       router_z_loss_coef=0.001 if aux else 0.0, output_router_logits=aux)
  c.model.moe.fixed_buffers = fixed_buffers   # MoE: the traced path's static buffers (not in the reference)
  if lora:                                   # LoRA (model/lora.py) on every linear, base frozen
    peft = c.model_alignment_strategy.peft
    peft.lora_rank, peft.target_modules, peft.lora_alpha, peft.lora_dropout = lora, ('all-linear',), 8.0, lora_dropout
    c.trainer.gradient_clip_val = 0.1        # B = 0 at init: early grad norms are ~0.12-0.26
  if objective != 'next_token':              # preference pairs in `sft` (data/preference.py)
    c.model.objective = objective
    c.model_alignment_strategy.dpo.precompute_ref_log_probs = precompute
    c.model_alignment_strategy.orpo.nll_reduction = nll_reduction   # token: over the global batch's chosen tokens
    c.trainer.gradient_clip_val = 0.02 if lora else 0.1   # DPO's first grad norms: ~0.3, ~0.04 with LoRA
  return c


def write_pairs(path, count, seed, chosen_ids=(0, 16), rejected_ids=(16, 32), prompt_ids=(0, 32)):
  """`count` random pre-tokenized preference pairs as JSONL at `path` (prompts of 2-4 tokens,
  responses of 1-3 drawn from the given id ranges); returns the rows."""
  g = np.random.default_rng(seed)
  rows = [{'prompt_input_ids': g.integers(*prompt_ids, int(g.integers(2, 5))).tolist(),
           'chosen_input_ids': g.integers(*chosen_ids, int(g.integers(1, 4))).tolist(),
           'rejected_input_ids': g.integers(*rejected_ids, int(g.integers(1, 4))).tolist()} for _ in range(count)]
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return rows


def apply_family(model, family):
  """Mistral: every layer a sliding window shorter than the sequence (16); Gemma 3: its block
  (GeGLU, (1 + w) norms, q/k norms, sandwich norms, scaled embeddings and scores, tied
  tables), local and global layers alternating with their own RoPE bases, head_dim != h / a.
  Qwen3, Qwen3-MoE, OLMo 2, SmolLM3, Phi-3 (tests/test_family_layouts.py): every feature of the
  family on (tests/test_hf_families.py checks each against transformers)."""
  model.sliding_window = 5
  model.architecture = family
  n = model.num_layers
  if family == 'gemma3':
    model.activation = 'geglu'
    model.rmsnorm_unit_offset = model.qk_norm = model.sandwich_norm = model.scale_embeddings = True
    model.share_embeddings_and_output_weights = True
    model.head_dim, model.query_pre_attn_scalar = 16, 12
    model.layer_types = ('sliding_attention', 'full_attention') * (n // 2)
    model.rope_theta, model.rope_local_theta = 1e6, 1e4
  elif family in ('qwen3', 'qwen3_moe'):
    # per-head q/k norms; 4 heads x 16 = 64 != hidden 32; Qwen3: layer 0 full, the rest slide
    # (HF max_window_layers=1); Qwen3-MoE slides every layer or none (HF's)
    model.qk_norm, model.qk_norm_span, model.head_dim = True, 'head', 16
    if family == 'qwen3':
      model.layer_types = ('full_attention',) + ('sliding_attention',) * (n - 1)
    else:
      # HF's Qwen3-MoE: dropless top-2 of 4 experts of their own width, renormalized, no shared
      # expert, the load-balancing loss at HF's weight; every 2nd layer MoE (decoder_sparse_step) but layer 3,
      # kept dense (mlp_only_layers): at 8 layers MoE in 1, 5, 7 (both pp2 stages), dense in 0, 2, 3, 4, 6
      model.moe.update(num_experts=4, top_k=2, dropless=True, ffn_hidden_size=48, normalize_top_k_affinities=True,
                       shared_expert_intermediate_size=0, frequency=2, dense_layers=(3,),
                       output_router_logits=True, router_aux_loss_coef=0.001)
  elif family == 'olmo2':
    # q/k norms over the whole projection, norms after attention and MLP only, scale in fp32;
    # one KV head: tp2 holds it twice (kv_replicator 2), so the k-norm's sum over TP is halved
    model.sliding_window = 0
    model.qk_norm, model.qk_norm_span, model.num_kv_heads = True, 'projection', 1
    model.post_norms_only = model.rmsnorm_scale_in_fp32 = True
  elif family == 'smollm3':
    # no RoPE in every 2nd layer (HF no_rope_layer_interval), those layers slide
    model.nope_layers = tuple(range(1, n, 2))
    model.layer_types = tuple('sliding_attention' if i % 2 else 'full_attention' for i in range(n))
  elif family == 'phi3':
    model.rotary_percentage = 0.5            # half of each head's 8 dims rotated; window 5 everywhere
  elif family == 'gpt_oss':
    # sinks, biases on every linear (router and experts too), norms scaled in fp32, YaRN without
    # truncation, sliding and full layers alternating; every layer dropless top-2 of 4 experts
    # (softmax over the top 2) with the clamped SwiGLU at a limit the tiny model's gates reach
    model.attention_sinks = model.has_bias = model.rmsnorm_scale_in_fp32 = True
    model.head_dim = 16
    model.layer_types = ('sliding_attention', 'full_attention') * (n // 2)
    model.rope_scaling.update(type='yarn', factor=4.0, original_max_position_embeddings=8, truncate=False)
    model.moe.update(num_experts=4, top_k=2, dropless=True, ffn_hidden_size=0, normalize_top_k_affinities=True,
                     shared_expert_intermediate_size=0, frequency=1, dense_layers=(), expert_activation='clamped_swiglu',
                     swiglu_limit=0.05, output_router_logits=True, router_aux_loss_coef=0.001)
  elif family == 'llama4':
    # chunked attention (chunks of 5) on the RoPE layers, their rotary pairs interleaved and
    # q / k L2-normed; NoPE layers 1, 3 with full attention and the temperature (rising every 4
    # positions); MoE in layers 1, 3 (interleave step 2): top-1 of 4 sigmoid-scored experts
    # scaling their input, and an ungated shared expert
    model.sliding_window = 0
    model.nope_layers = tuple(range(1, n, 2))
    model.layer_types = tuple('full_attention' if i % 2 else 'chunked_attention' for i in range(n))
    model.attention_chunk_size, model.rope_interleave, model.qk_l2_norm = 5, True, True
    model.attn_temperature_tuning, model.attn_floor_scale, model.attn_scale = True, 4, 0.5
    model.rope_scaling.update(type='llama3', factor=8.0, original_max_position_embeddings=8)
    model.moe.update(num_experts=4, top_k=1, router_activation='sigmoid', normalize_top_k_affinities=False,
                     scale_expert_input=True, dropless=True, ffn_hidden_size=16, shared_expert_intermediate_size=16,
                     shared_expert_gate=False, dense_layers=tuple(range(0, n, 2)), frequency=1,
                     output_router_logits=True, router_aux_loss_coef=0.001)
  elif family == 'deepseek_v3':
    # latent attention (a q bottleneck, the shared key RoPE part stored interleaved, values
    # narrower than keys), YaRN with DeepSeek's mscale; layer 0 dense, then 8 sigmoid-scored
    # experts in 4 groups (top 2 of the best 2 groups) with the correction bias, the weights x 2.5,
    # and one ungated shared expert
    model.sliding_window, model.num_kv_heads = 0, model.num_attention_heads    # a key and value per head
    model.mla.update(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                     rope_interleave=True)
    model.head_dim = 12
    model.rope_scaling.update(type='yarn', factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                              mscale_all_dim=1.0)
    model.moe.update(num_experts=8, top_k=2, num_groups=4, top_k_groups=2, router_activation='sigmoid',
                     load_balance_bias=True, routed_scaling_factor=2.5, normalize_top_k_affinities=True,
                     dropless=True, ffn_hidden_size=16, shared_expert_intermediate_size=16, shared_expert_gate=False,
                     dense_layers=(0,), frequency=1, output_router_logits=True, router_aux_loss_coef=0.001)


def steps_on_rank(config, steps):
  """`steps` training steps of `config` on this rank (no loop, no files); its parameters."""
  mesh = meshes.init(config)
  params = training.init_params(config, mesh)
  updater = update.Updater(params, config, mesh)
  for step in range(steps):
    batches = Loader(config, 'train', mesh.dp_rank, mesh.dp).global_batch(step * config.data.global_batch_size)
    training.train_step(params, updater, batches, config, step, mesh, tensor.make_ops(mesh))
  return {n: p.detach().float().numpy() for n, p in params.items()}   # bf16 exactly in fp32


def train_on_rank(workdir, layout):
  """On every rank: train, then return (losses, grad norms) from rank 0 and this rank's boxes."""
  config = parity_config(**layout)
  _, params = train.run(config, workdir)
  return rank_result(config, workdir, params)


def rank_result(config, workdir, params):
  """(losses, grad norms) from rank 0's metrics.jsonl, and this rank's boxes."""
  d = config.distributed_strategy
  tp, pp, cp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.context_parallel_size
  mesh = meshes.Mesh(tp=tp, pp=pp, cp=cp, rank=int(os.environ.get('RANK', 0)), kv_replicator=d.kv_replicator,
                     dp=int(os.environ.get('WORLD_SIZE', 1)) // (tp * pp * cp), ep=d.expert_model_parallel_size)
  boxes = tensor.boxes(config.model, mesh, list(params))
  losses, norms = None, None
  if mesh.rank == 0:
    records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
    losses = [r['loss'] for r in records if 'loss' in r]
    norms = [r['grad_norm'] for r in records if 'loss' in r]
  shards = param_shards.shards_of(params)
  if shards is not None:               # ZeRO-3: this rank's owned rows of each box
    return losses, norms, {n: ((slice(boxes[n][0].start + shards.rows[n].start, boxes[n][0].start + shards.rows[n].stop),)
                               + tuple(boxes[n][1:]), t.float().numpy()) for n, t in shards.shard.items()}
  return losses, norms, {n: (boxes[n], p.detach().float().numpy()) for n, p in params.items()}


def assemble(rank_results, model_cfg):
  """Global parameters (unpadded vocab) from every rank's boxes; replicas must agree exactly."""
  pieces = {}
  for _, _, boxes in rank_results:
    for name, (box, value) in boxes.items():
      pieces.setdefault(name, []).append((box, value))
  out = {}
  for name, parts in pieces.items():
    shape = [max(box[i].stop for box, _ in parts) for i in range(parts[0][1].ndim)]
    array = np.zeros(shape, dtype=np.float32)
    written = {}
    for box, value in parts:
      key = tuple((sl.start, sl.stop) for sl in box)
      if key in written:                    # replicas (TP-replicated, KV copies, tied) must agree
        np.testing.assert_array_equal(value, written[key], err_msg=f'replicas of {name} diverged')
      written[key] = value
      array[box] = value
    out[name] = array[:model_cfg.vocab_size] if name in tensor.VOCAB_TABLES else array
  return out


_REFERENCES = {}


def reference(tmp_path_factory, **model_layout):
  """The single-device run of the config (cached per model setting)."""
  key = tuple(sorted(model_layout.items()))
  if key not in _REFERENCES:
    results = [train_on_rank(str(tmp_path_factory.mktemp('single')), model_layout)]
    _REFERENCES[key] = results[0][0], results[0][1], assemble(results, parity_config(**model_layout).model)
  return _REFERENCES[key]


# what the reference run depends on
MODEL_KEYS = ('dropout', 'attention_dropout', 'nll_reduction', 'layers', 'tied', 'precision', 'sft', 'lora', 'lora_dropout', 'objective', 'precompute',
              'qkv_bias', 'rope_llama3', 'family', 'moe', 'capacity', 'aux', 'fp8', 'steps', 'lr', 'balance_rate', 'optim')


def train_layouts_on_rank(workdirs, layouts):
  """train_on_rank for each layout in turn, in one process: one spawned world trains several
  layouts (spawning and initializing a world costs seconds; a fresh mesh's groups per layout)."""
  return [train_on_rank(workdir, layout) for workdir, layout in zip(workdirs, layouts)]


def check_layouts(layouts, tmp_path, tmp_path_factory, **tolerances):
  """Train every `name: (world size, layout)` on its world size and assert it trains like one
  device (`compare`), the layouts of one world size one after another in one spawned world;
  returns {name: assembled global parameters}."""
  out = {}
  for world_size in world_sizes(layouts):
    names = list(of_size(layouts, world_size))
    # world.run's timeout bounds the wait for all of the world's layouts
    per_rank = world.run(train_layouts_on_rank, world_size, [str(tmp_path / n) for n in names],
                         [layouts[n][1] for n in names], timeout=240 * len(names))
    for i, name in enumerate(names):
      out[name] = compare(name, layouts[name][1], [rank[i] for rank in per_rank], tmp_path_factory, **tolerances)
  return out


def world_sizes(layouts):
  """The world sizes of `name: (world size, layout)` (a test parametrized by these trains each
  size's layouts in one world)."""
  return sorted({size for size, _ in layouts.values()})


def of_size(layouts, world_size):
  return {name: v for name, v in layouts.items() if v[0] == world_size}


def compare(name, layout, results, tmp_path_factory, loss_rtol=1e-5, param_atol=1e-5, norm_rtol=1e-4):
  """Assert every rank's results of `layout` train like one device; the assembled parameters."""
  ref_losses, ref_norms, ref_params = reference(
      tmp_path_factory, **{k: v for k, v in layout.items() if k in MODEL_KEYS})
  losses, norms, _ = results[0]
  assert ref_norms[0] > parity_config(**layout).trainer.gradient_clip_val, name   # clipping was active
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol, err_msg=name)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol, err_msg=name)
  params = assemble(results, parity_config(**layout).model)
  assert params.keys() == ref_params.keys(), name
  worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
  worst_param = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
  worst_norm = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
  print(f'{name}: worst relative loss error {worst_loss:.2e}, worst parameter error {worst_param:.2e}, '
        f'worst relative grad-norm error {worst_norm:.2e}')
  for n in ref_params:
    np.testing.assert_allclose(params[n], ref_params[n], rtol=1e-5, atol=param_atol, err_msg=f'{name}: {n}')
  return params
