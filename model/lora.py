"""LoRA (Hu et al. 2021) exactly as peft computes it, on the flat parameter dict.

A targeted linear `W` (name `<prefix>.<module>.weight`, [out, in]) gets two parameters named
as peft names them, `<prefix>.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]:

    y = W x + b + scaling * B (A dropout(x)),   scaling = alpha / r  (alpha / sqrt(r): rsLoRA)

A starts as peft's kaiming-uniform (uniform in +-1/sqrt(in)), B at zero, so step 0 is the base
model. The base is frozen; adapters are fp32 parameters whatever the recipe (the base may be
bf16) and compute in the activations' dtype. Settings come from `cfg.peft`, the
model_alignment_strategy.peft section; which linears are adapted, and each one's r and alpha,
is model/lora_targets.py's (`settings` and `option` are re-exported here for the forward).

Nothing here knows about parallelism: parallel/tensor.py decides which box of A and B a rank
holds (Megatron's way: A replicated and B split for column-parallel targets, A split and B
replicated for row-parallel ones) and the adapter's partial output of a row-parallel target
joins the base layer's own reduction (`layers.linear`). A's rows are never split, so a
linear's rank is the first dimension of its A. Phi-3's fused modules share one A among their
projections (model/lora_fused.py).
"""
import math
import os

import torch
import torch.nn.functional as F

from model import lora_fused
from model.lora_targets import alpha_of, option, plan, settings

FACTORS = ('lora_A', 'lora_B')


def adapter_source(peft) -> str:
  """Where load_lora_from_ckpt reads the starting adapter: lora_save_dir/lora_load_tag."""
  return os.path.join(peft.lora_save_dir, peft.lora_load_tag or '')


def scaling(peft, linear, rank) -> float:
  """alpha / r (alpha / sqrt(r) with rsLoRA) of `linear`, whose adapter has rank `rank`
  (the first dimension of its A: never split)."""
  return alpha_of(peft, linear) / (math.sqrt(rank) if option(peft, 'use_rslora') else rank)


def split_name(name):
  """'layers.0.self_attn.q_proj.lora_A.weight' -> ('layers.0.self_attn.q_proj', 'lora_A'); else None."""
  parts = name.split('.')
  if len(parts) >= 3 and parts[-2] in FACTORS:
    return '.'.join(parts[:-2]), parts[-2]
  return None


def is_adapter(name) -> bool:
  return split_name(name) is not None


# Megatron's split of a factor pair by its base layer's layout: a column layer's B is split like
# its weight and A replicated, a row layer's A like its weight and B replicated. A replicated
# factor sees only this rank's shard of the layer: its gradient is partial over TP.
FACTOR_LAYOUTS = {'column': ('tp_partial', 'column'), 'column_kv': ('tp_partial', 'column_kv'),
                  'row': ('row', 'tp_partial'), 'tp_partial': ('tp_partial', 'tp_partial')}


def adapter_specs(cfg, base_specs, spec_type) -> dict:
  """name -> spec of every adapter factor, for the targeted linear weights in `base_specs`: A
  named after the module (one for Phi-3's fused projections: the same input, rank and layout),
  B after the linear."""
  out = {}
  for linear, (rank, _) in plan(cfg, base_specs).items():
    base = base_specs[linear + '.weight']
    out_dim, in_dim = base.shape
    a, b = FACTOR_LAYOUTS[base.layout]
    out[f'{lora_fused.module_of(cfg, linear)}.lora_A.weight'] = spec_type(
        (rank, in_dim), 'uniform', 1.0 / math.sqrt(in_dim), layout=a)
    out[f'{linear}.lora_B.weight'] = spec_type((out_dim, rank), 'zeros', layout=b)
  return out


# updated by a rule, never by a gradient: DeepSeek-V3's load-balancing bias (model/moe.py)
UNTRAINED = ('.e_score_correction_bias',)


def trainable(cfg, names) -> list:
  """The names that train: with LoRA the adapters (and the biases `lora_bias` names), else all
  (but UNTRAINED's)."""
  peft = settings(cfg)
  if peft is None:
    return [n for n in names if not n.endswith(UNTRAINED)]
  names = list(names)
  adapted = {split_name(n)[0] for n in names if is_adapter(n)}
  keep = []
  for n in names:
    if is_adapter(n):
      keep.append(n)
    elif n.endswith('.bias') and (option(peft, 'lora_bias') == 'all' or
                                  (option(peft, 'lora_bias') == 'lora_only' and n[:-len('.bias')] in adapted)):
      keep.append(n)
  return keep


def delta(params, linear, x, cfg, dropout, first_linear=F.linear):
  """The adapter's contribution to `linear`'s output for input `x` (None if not adapted):
  scaling * B (A dropout(x)), in x's dtype. `dropout(x, p, site)` applies the keyed dropout of
  module `site` (Phi-3's q, k and v draw their fused qkv_proj's one mask); `first_linear` runs A
  (the base layer's own linear, so that under SP A keeps what it keeps)."""
  b = params.get(linear + '.lora_B.weight')
  if b is None:
    return None
  module, peft = lora_fused.module_of(cfg, linear), cfg.peft
  a = params[module + '.lora_A.weight']
  x = dropout(x, option(peft, 'lora_dropout'), module.rsplit('.', 1)[-1])
  return F.linear(first_linear(x, a.to(x.dtype)), b.to(x.dtype)) * scaling(peft, module, rank=a.shape[0])


def merged(params, cfg) -> dict:
  """Base weights with every adapter folded in (W + scaling B A), without the adapter
  factors: the full model that equals base + adapters (needs whole, unsharded tensors)."""
  peft = settings(cfg)
  out = {n: p for n, p in params.items() if not is_adapter(n)}
  if peft is None:
    return out
  for name in params:
    split = split_name(name)
    if split and split[1] == 'lora_B':
      module = lora_fused.module_of(cfg, split[0])
      w, a = params[split[0] + '.weight'], params[module + '.lora_A.weight']
      product = params[name].double() @ a.double()
      s = scaling(peft, module, rank=a.shape[0])
      out[split[0] + '.weight'] = (w.double() + s * product).to(w.dtype)
  return out


def param_dtype(name, base_dtype):
  """Adapters are fp32 whatever the recipe; the (frozen) base keeps the recipe's dtype."""
  return torch.float32 if is_adapter(name) else base_dtype


def stored(cfg, names) -> list:
  """What a checkpoint step of a run holds of parameters `names`: everything without LoRA;
  with LoRA the trained ones (adapters, trained biases), plus the frozen base with
  save_lora_base, or only the merged base with merge_lora."""
  peft = settings(cfg)
  if peft is None:
    return list(names)
  if peft.merge_lora:
    return [n for n in names if not is_adapter(n)]
  trained = set(trainable(cfg, names))
  return [n for n in names if n in trained or peft.save_lora_base]


def checkpoint_kind(cfg) -> str:
  """metadata.json's `lora.stored`: 'adapters', 'adapters+base' or 'merged'."""
  peft = settings(cfg)
  return 'merged' if peft.merge_lora else 'adapters+base' if peft.save_lora_base else 'adapters'
