"""Every parameter of the model as a spec (global shape, init, tensor-parallel layout), from the
config alone: counting parameters needs no memory, init of any shard is a pure function of
(seed, name) (model/param_init.py), and the parallel code reads each layout where the model
declares it (parallel/tensor.py, parallel/grads.py)."""
import dataclasses
import math

from model import layers, lora, lora_fused, mla, moe

head_dim = layers.head_dim


# How a parameter is laid out over the tensor-parallel group, declared where it is defined:
#   vocab, column (output rows split), column_kv (rows of KV heads: split, or held by kv_replicator
#   ranks each), row (input columns split), expert_column / expert_row (a stack of experts [E, ...]
#   split like the dense MLP; dim 0 over expert parallelism), replicated (every rank holds it whole
#   and applies it to its tokens: under SP a shard of them), replicated_whole_sequence (whole, applied
#   before the sequence is split), tp_partial (whole, but each rank's gradient comes from its shard of
#   the layer: per-head norms, LoRA's replicated factors).
LAYOUTS = ('vocab', 'column', 'column_kv', 'row', 'expert_column', 'expert_row', 'replicated',
           'replicated_whole_sequence', 'tp_partial')


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple
  init: str          # normal | uniform (in +-std) | ones | zeros
  std: float = 0.0
  used_rows: int = 0  # vocab tables: rows past the real vocabulary are padding, initialized to 0
  layout: str = ''   # one of LAYOUTS; none declared is refused (check_layouts)


def padded_vocab_size(cfg, tp=1) -> int:
  multiple = cfg.make_vocab_size_divisible_by * tp
  return int(math.ceil(cfg.vocab_size / multiple) * multiple)


def kv_heads(cfg) -> int:
  return cfg.num_kv_heads or cfg.num_attention_heads


def param_specs(cfg, tp=1, adapters=True) -> dict:
  """Global name -> ParamSpec, in forward order. `cfg` is the `model` section; LoRA factors
  are included when cfg.peft enables them, unless `adapters` is False (the base model)."""
  h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, head_dim(cfg)
  std = cfg.init_method_std
  out_std = std / math.sqrt(2 * cfg.num_layers) if cfg.use_scaled_init_method else std
  vocab_table = ParamSpec((padded_vocab_size(cfg, tp), h), 'normal', std, used_rows=cfg.vocab_size, layout='vocab')
  specs = {'embed_tokens.weight': vocab_table}
  if cfg.position_embedding_type == 'learned_absolute':
    specs['embed_positions.weight'] = ParamSpec((cfg.max_position_embeddings, h), 'normal', std,
                                                layout='replicated_whole_sequence')

  def norm_specs(name, width=h, layout='replicated'):
    # (1 + w) norms (Gemma) start at w = 0: the same identity scale
    specs[name + '.weight'] = ParamSpec((width,), 'zeros' if cfg.get('rmsnorm_unit_offset') else 'ones', layout=layout)
    if cfg.normalization == 'layernorm':
      specs[name + '.bias'] = ParamSpec((h,), 'zeros', layout=layout)

  def linear_specs(name, out_dim, in_dim, w_std, layout):
    specs[name + '.weight'] = ParamSpec((out_dim, in_dim), 'normal', w_std, layout=layout)
    if cfg.has_bias or (cfg.get('qkv_bias') and name.endswith(('q_proj', 'k_proj', 'v_proj'))):
      # a column layer's bias is split like its rows; a row layer's is added after the reduction
      specs[name + '.bias'] = ParamSpec((out_dim,), 'zeros', layout='replicated' if layout == 'row' else layout)

  after_only = cfg.get('post_norms_only')
  for i in range(cfg.num_layers):
    p = f'layers.{i}'
    if not after_only:
      norm_specs(p + '.input_layernorm')
    if mla.enabled(cfg):            # DeepSeek's latent attention (model/mla.py)
      specs.update(mla.specs(cfg, p + '.self_attn', ParamSpec, std, out_std))
    else:
      linear_specs(p + '.self_attn.q_proj', cfg.num_attention_heads * d, h, std, 'column')
      linear_specs(p + '.self_attn.k_proj', kv_heads(cfg) * d, h, std, 'column_kv')
      linear_specs(p + '.self_attn.v_proj', kv_heads(cfg) * d, h, std, 'column_kv')
    if cfg.get('qk_norm') and cfg.get('qk_norm_span', 'head') == 'projection':   # split like q and k's rows
      norm_specs(p + '.self_attn.q_norm', cfg.num_attention_heads * d, 'column')
      norm_specs(p + '.self_attn.k_norm', kv_heads(cfg) * d, 'column_kv')
    elif cfg.get('qk_norm'):        # over each head: every TP rank holds the weight, applies it to its heads
      norm_specs(p + '.self_attn.q_norm', d, 'tp_partial')
      norm_specs(p + '.self_attn.k_norm', d, 'tp_partial')
    if cfg.get('attention_sinks'):    # one logit per query head, split over TP with the heads
      specs[p + '.self_attn.sinks'] = ParamSpec((cfg.num_attention_heads,), 'normal', std, layout='column')
    if not mla.enabled(cfg):
      linear_specs(p + '.self_attn.o_proj', h, cfg.num_attention_heads * d, out_std, 'row')
    norm_specs(p + '.post_attention_layernorm')
    if cfg.get('sandwich_norm'):
      norm_specs(p + '.pre_feedforward_layernorm')
    if moe.is_moe_layer(cfg, i):
      specs.update(moe.specs(cfg, p + '.mlp', ParamSpec, std, out_std))
    else:
      if cfg.activation in layers.GATED:
        linear_specs(p + '.mlp.gate_proj', f, h, std, 'column')
      linear_specs(p + '.mlp.up_proj', f, h, std, 'column')
      linear_specs(p + '.mlp.down_proj', h, f, out_std, 'row')
    if cfg.get('sandwich_norm') or after_only:
      norm_specs(p + '.post_feedforward_layernorm')
  norm_specs('norm')
  if not cfg.share_embeddings_and_output_weights:
    specs['lm_head.weight'] = vocab_table
  return check_layouts(_with_adapters(specs, lora.adapter_specs(cfg, specs, ParamSpec) if adapters else {}))


def check_layouts(specs):
  """`specs`, after refusing any parameter without a declared layout: one the parallel code would
  otherwise have to guess (and a guess of replicated trains a new projection wrongly under TP)."""
  undeclared = sorted(name for name, spec in specs.items() if spec.layout not in LAYOUTS)
  if undeclared:
    raise ValueError(f'parameters without a declared tensor-parallel layout: {", ".join(undeclared[:5])}'
                     f'{" ..." if len(undeclared) > 5 else ""}; declare one of {", ".join(LAYOUTS)} in their '
                     'ParamSpec where the model defines them (model/param_table.py param_specs)')
  return specs


def _with_adapters(specs, adapters):
  """`specs` with each LoRA factor right after the weight it adapts (forward order)."""
  if not adapters:
    return specs
  out = {}
  for name, spec in specs.items():
    out[name] = spec
    linear = name[:-len('.weight')]
    for factor in lora_fused.factor_names(linear):    # (Phi-3's shared A before its first projection's B)
      if factor in adapters:
        out.setdefault(factor, adapters[factor])
  return out


def count_params(cfg, embedding=True, trainable_only=False) -> int:
  """Unpadded-vocab parameter count (the published size); embedding=False drops the input
  table, trainable_only counts what trains (with LoRA: the adapters and trained biases)."""
  total = 0
  specs = param_specs(cfg)
  trained = set(lora.trainable(cfg, specs)) if trainable_only else specs
  for name, spec in specs.items():
    if name not in trained:
      continue
    if name in ('embed_tokens.weight', 'lm_head.weight'):
      shape = (cfg.vocab_size,) + spec.shape[1:]
      if name == 'embed_tokens.weight' and not embedding and not cfg.share_embeddings_and_output_weights:
        continue
    elif name == 'embed_positions.weight' and not embedding:
      continue
    else:
      shape = spec.shape
    total += math.prod(shape)
  return total


def is_hidden_matrix(name, ndim) -> bool:
  """Whether parameter `name` (of global rank `ndim`) is one of the layers' matrices, what matrix
  optimizers (Muon: optim/muon.py) step: every 2-D weight of a layer, each expert's matrix of a
  stack, LoRA's factors; not embeddings, the head, norms, biases or sinks."""
  return name.startswith('layers.') and ndim >= 2 and not name.endswith('.bias')
