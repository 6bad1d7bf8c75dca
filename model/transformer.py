"""The Megatron/Llama decoder as data (a flat dict of global-named tensors) and pure functions.

Parameter names are Hugging Face Llama's without the leading `model.`
(`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, `lm_head.weight`), so
import/export is a rename. `param_specs` describes every tensor (global shape, init) from the
config alone: counting parameters needs no memory, and init of any shard is a pure function
of (seed, name).
"""
import dataclasses
import typing
from typing import Optional

import torch

from model import attention, chunked_ce, layers, lora, mla, moe, objectives, param_init, rope, router_losses
from model.param_table import param_specs


head_dim = layers.head_dim


class LayerInputs(typing.NamedTuple):
  """What differs between layers, handed to `block` as one bundle. A feature that differs by
  layer is a field here, set in `stage`: model.compile traces the block once per distinct bundle
  and at `index` 0 (parallel/compiled.py), so the block must not branch on `index` itself."""
  index: int                  # the layer's number: its parameters' prefix `layers.{index}`
  cos_sin: typing.Any         # RoPE's (cos, sin), Llama 4's query temperature on a NoPE layer, or None
  mask: typing.Any            # this layer kind's attention mask (a tensor, or the ring's layers.Attend)
  drop_key: Optional[tuple]   # keys this layer's dropout (None: no dropout)
  sample_ids: Optional[torch.Tensor]   # [b] global sample indices (dropout masks by sample)
  moe: bool = False           # the MLP is model/moe.py's experts
  kv: typing.Any = None       # generation: (earlier positions' cache or None, the cache this step fills)


def layer_types(cfg) -> tuple:
  """Each layer's attention, HF's names: 'full_attention' or 'sliding_attention' (the last
  model.sliding_window positions). Empty model.layer_types: every layer slides when a window
  is set (Mistral), none otherwise."""
  if cfg.get('layer_types'):
    return tuple(cfg.layer_types)
  kind = 'sliding_attention' if cfg.get('sliding_window') else 'full_attention'
  return (kind,) * cfg.num_layers


def _rope_by_type(cfg, position_ids_bs, dtype):
  """cos, sin per layer type: sliding layers use their own unscaled base when
  model.rope_local_theta is set (Gemma 3), else every layer uses rope_theta with rope_scaling."""
  rot_dim = cfg.mla.qk_rope_head_dim if mla.enabled(cfg) else int(head_dim(cfg) * cfg.rotary_percentage) // 2 * 2
  full = rope.rope_cos_sin(position_ids_bs, rot_dim, cfg.rope_theta, dtype, cfg.get('rope_scaling'),
                             cfg.max_position_embeddings)
  local_theta = cfg.get('rope_local_theta')
  local = rope.rope_cos_sin(position_ids_bs, rot_dim, local_theta, dtype) if local_theta else full
  return {'full_attention': full, 'sliding_attention': local, 'chunked_attention': full}


def _masks_by_type(cfg, batch, s, device, ops=layers.LOCAL_OPS):
  """Each layer type's mask; under context parallelism its `layers.Attend` (the ring)."""
  kv = batch.get('kv_cache')
  past = kv[0].length if kv is not None and kv[0] is not None else None
  out = {}
  for kind in set(layer_types(cfg)):
    window = cfg.sliding_window if kind == 'sliding_attention' else 0
    chunk = cfg.attention_chunk_size if kind == 'chunked_attention' else 0
    if ops.context_attention is not None:
      out[kind] = ops.context_attention(batch, window, chunk)
      continue
    out[kind] = (attention.causal_mask_after(past, s, device, window, chunk) if past is not None else
                 attention.attention_mask(batch.get('segment_ids'), s, window, device, chunk))
  return out


def init(cfg, seed: int, device='cpu', dtype=torch.float32, boxes=None, tp=1) -> dict:
  """Fresh parameters (or, with `boxes`, this rank's boxes of them): pure functions of (seed, name)."""
  specs = param_specs(cfg, tp)
  boxes = boxes or {name: None for name in specs}
  return {name: param_init.init_box(specs[name], seed, name, box).to(device=device, dtype=lora.param_dtype(name, dtype))
          .requires_grad_() for name, box in boxes.items()}


def forward(params, tokens_bs, cfg, ops=layers.LOCAL_OPS, *, position_ids_bs=None,
            segment_ids_bs=None, sample_ids_b=None, dropout_key: Optional[tuple] = None,
            layer_fn=None):
  """Logits [b, s, V_padded/t] of the whole model (see `stage` for the arguments)."""
  batch = {'tokens': tokens_bs, 'position_ids': position_ids_bs, 'segment_ids': segment_ids_bs,
           'sample_ids': sample_ids_b}
  return stage(params, batch, cfg, ops, dropout_key=dropout_key, layer_fn=layer_fn, objective=None)


class KVCache(typing.NamedTuple):
  """Keys and values [b, g, length, d] of every layer for the positions seen so far."""
  keys: dict
  values: dict
  length: int


def decode(params, tokens_bs, cfg, cache=None):
  """Logits of `tokens_bs`, which continue the positions in `cache` (None: from position 0),
  and the cache extended by them: generation as a pure function, on one device."""
  b, s = tokens_bs.shape
  past = cache.length if cache is not None else 0
  new = KVCache({}, {}, past + s)
  batch = {'tokens': tokens_bs, 'kv_cache': (cache, new),
           'position_ids': (past + torch.arange(s, device=tokens_bs.device)).expand(b, s)}
  return stage(params, batch, cfg, objective=None), new


def stage(params, batch, cfg, ops=layers.LOCAL_OPS, *, layer_range=None, x_bsh=None, last=True,
          dropout_key: Optional[tuple] = None, layer_fn=None, objective=objectives.NEXT_TOKEN, moe_carry=None):
  """A contiguous piece of the model: [embedding] -> layers [lo, hi) -> [norm, head, loss].

  The embedding runs when `x_bsh` is None (the first pipeline stage); otherwise `x_bsh` is the
  previous stage's output. With `last`, returns the objective's (loss sum, metric sums), or the
  logits when `objective` is None; else the hidden states, with `moe_carry` (the MoE losses'
  sums of the earlier stages, zeros on the first: router_losses.Collector) (hidden, its carry).
  `batch`: tokens, labels, loss_mask, optional position_ids, segment_ids (per-document masks),
  sample_ids (keys dropout), kv_cache (generation: (earlier positions' cache or None, an empty
  KVCache each layer fills)). `dropout_key` (seed, 'dropout') enables dropout; `layer_fn(fn,
  params, layer, x_bsh, cfg, ops)` runs each block (recompute, ZeRO-3's gathers, model.compile).
  """
  tokens_bs = batch['tokens']
  b, s = tokens_bs.shape
  position_ids_bs = batch.get('position_ids')
  if position_ids_bs is None:
    position_ids_bs = torch.arange(s, device=tokens_bs.device).expand(b, s)
  sample_ids_b = batch.get('sample_ids')
  if x_bsh is None:
    table = params['embed_tokens.weight']
    x_bsh = ops.embed(tokens_bs, table)
    if cfg.get('scale_embeddings'):       # Gemma: times sqrt(h), rounded to the table's dtype as HF
      x_bsh = x_bsh * torch.tensor(cfg.hidden_size ** 0.5, dtype=table.dtype)
    if cfg.position_embedding_type == 'learned_absolute':
      x_bsh = x_bsh + params['embed_positions.weight'][position_ids_bs]
    x_bsh = layers.dropout(x_bsh, cfg.hidden_dropout, dropout_key and dropout_key + ('embed',), sample_ids_b, ops=ops)
    x_bsh = ops.slice_residual(x_bsh)
  rope_tables = _rope_by_type(cfg, position_ids_bs, x_bsh.dtype) if cfg.position_embedding_type == 'rope' else {}
  nope = set(cfg.get('nope_layers', ()))
  no_rope = None              # what a NoPE layer gets: nothing, or Llama 4's query temperature
  if nope and cfg.get('attn_temperature_tuning'):
    kv_in = batch.get('kv_cache')
    past = kv_in[0].length if kv_in is not None and kv_in[0] is not None else 0
    positions = past + torch.arange(s * ops.context_size, device=tokens_bs.device)
    if ops.context_size > 1:              # the sequence indices of this rank's slice (HF's cache_position)
      positions = ops.context_slice(positions[None])[0]
    no_rope = attention.temperature(cfg, positions)
  masks = _masks_by_type(cfg, batch, s, tokens_bs.device, ops)
  kv = batch.get('kv_cache')
  layer_fn = layer_fn or (lambda fn, *args: fn(*args))
  lo, hi = layer_range or (0, cfg.num_layers)
  kinds = layer_types(cfg)
  collector = None
  if moe.enabled(cfg):
    count_rows = objective is not None and objective.row_count
    weights = objective.row_count(batch) if count_rows else torch.ones(b, device=tokens_bs.device)
    moe_here = sum(moe.is_moe_layer(cfg, i) for i in range(lo, hi))
    collector = router_losses.Collector(cfg, weights, s * ops.context_size, moe_carry, moe_here, ops.row_sum,
                                        ops.expert_loads)
    ops = dataclasses.replace(ops, moe=collector)
  for i in range(lo, hi):
    key = dropout_key and dropout_key + (i,)
    layer = LayerInputs(i, no_rope if i in nope else rope_tables.get(kinds[i]), masks[kinds[i]], key,
                        sample_ids_b, moe.is_moe_layer(cfg, i), kv)
    x_bsh = layer_fn(block, params, layer, x_bsh, cfg, ops)
  aux_sum = collector and collector.finish(ops.moe_tally, last, objective is not None and objective.adds_aux)
  if not last:
    return x_bsh if moe_carry is None else (x_bsh, collector.carry())
  x_bsh = ops.full_input((ops.final_norm or layers.norm)(params, 'norm', x_bsh, cfg))
  head = params['embed_tokens.weight' if cfg.share_embeddings_and_output_weights else 'lm_head.weight']
  chunk = cfg.fusions.get('chunked_cross_entropy', 0)
  if objective is not None and chunk:     # the objective's losses run the head chunk by chunk
    return _with_aux(objective.loss(chunked_ce.HeadInput(x_bsh, head, chunk), batch, cfg, ops), aux_sum, ops)
  logits = ops.lm_head(x_bsh, head)
  return logits if objective is None else _with_aux(objective.loss(logits, batch, cfg, ops), aux_sum, ops)


def _with_aux(out, aux_sum, ops):
  """The objective's loss plus MoE's auxiliary losses; the objective's own is tallied as lm_loss."""
  loss, metrics = out
  if ops.moe_tally is not None and ops.moe is not None:
    ops.moe_tally['lm_loss'] = ops.moe_tally.get('lm_loss', 0) + loss.detach()
  return (loss, metrics) if aux_sum is None else (loss + aux_sum, metrics)


def block(params, layer: LayerInputs, x_bsh, cfg, ops):
  """One transformer layer. Pre-norm (Llama): x + attn(norm(x)), then + mlp(norm(x)); with
  model.sandwich_norm (Gemma) the attention and MLP outputs are normed too before the add; with
  model.post_norms_only (OLMo 2) only they are. `layer.cos_sin` None: no RoPE in this layer (NoPE);
  `layer.moe`: the MLP is model/moe.py's experts.

  `x_bsh` may be a slice of the residual stream (`ops.residual_slices`); residual dropout
  draws the whole sequence's mask and applies its part.
  """
  p, drop_key, sample_ids_b = f'layers.{layer.index}', layer.drop_key, layer.sample_ids

  def residual_dropout(h, site):
    if not drop_key or cfg.hidden_dropout == 0.0:
      return h
    full = (h.shape[1] * ops.residual_slices, h.shape[2])
    return layers.dropout(h, cfg.hidden_dropout, drop_key + (site,), sample_ids_b, full,
                          lambda m: ops.mask_for_slice(m, 'seq'), ops)

  sandwich, after_only = cfg.get('sandwich_norm'), cfg.get('post_norms_only')
  h = x_bsh if after_only else ops.recompute_norm(layers.norm, params, p + '.input_layernorm', x_bsh, cfg)
  h = attention.self_attention(params, p + '.self_attn', h, layer.cos_sin, layer.mask, cfg, ops, layer.index,
                               drop_key, sample_ids_b, layer.kv)
  if sandwich or after_only:
    h = layers.norm(params, p + '.post_attention_layernorm', h, cfg)
  x_bsh = x_bsh + residual_dropout(h, 'attn_out')
  h = x_bsh if after_only else ops.recompute_norm(
      layers.norm, params, p + ('.pre_feedforward_layernorm' if sandwich else '.post_attention_layernorm'), x_bsh, cfg)
  if layer.moe:       # SP: routes the whole (gathered) sequence, returns this rank's slice
    h = ops.recompute_mlp(moe.mlp, params, p + '.mlp', ops.full_input(h) if ops.residual_slices > 1 else h, cfg, ops)
  else:
    h = layers.mlp(params, p + '.mlp', h, cfg, ops, drop_key, sample_ids_b)
  if sandwich or after_only:
    h = layers.norm(params, p + '.post_feedforward_layernorm', h, cfg)
  return x_bsh + residual_dropout(h, 'mlp_out')


def loss_sum(params, batch, cfg, ops=layers.LOCAL_OPS, *, dropout_key=None, layer_fn=None):
  """Sum of masked next-token losses over the micro batch (the caller divides by the
  global token count, so every layout and accumulation split gives the same update)."""
  return stage(params, batch, cfg, ops, dropout_key=dropout_key, layer_fn=layer_fn)[0]
