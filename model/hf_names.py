"""Which tensor of an HF model's files holds each of ours: names (ours are HF's minus `model.`),
Mixtral's and Qwen-MoE's experts stored one tensor per expert (or as transformers 5's stacks),
Llama 4's transposed stacks, Phi-3's fused qkv_proj and gate_up_proj rows."""
from model import lora_fused, moe, param_table, transformer
from model.hf_config import MOE_FAMILIES
from model.hf_export import family_of


def to_hf_name(name):
  return name if name == 'lm_head.weight' else 'model.' + name


def from_hf_name(hf_name):
  return hf_name[len('model.'):] if hf_name.startswith('model.') else hf_name


def ignored(hf_name, model_cfg):
  """Tensors HF files may hold that carry nothing for us."""
  if hf_name == 'lm_head.weight' and model_cfg.share_embeddings_and_output_weights:
    return True   # tied: some writers store the (identical) head anyway
  parts = hf_name.split('.')
  if model_cfg.architecture == 'deepseek_v3' and parts[1:2] == ['layers'] and int(parts[2]) >= model_cfg.num_layers:
    return True   # DeepSeek-V3's multi-token-prediction layer (layers.61): transformers skips it too
  return hf_name.endswith('rotary_emb.inv_freq')   # old checkpoints saved this RoPE buffer


def few(names, k=5):
  names = sorted(names)
  return ', '.join(names[:k]) + (f' (+{len(names) - k} more)' if len(names) > k else '')


def family(model_cfg):
  return model_cfg.architecture if model_cfg.architecture in MOE_FAMILIES else family_of(model_cfg)


def fused_rows(name, model_cfg):
  """(Phi-3's fused HF tensor holding our weight `name`, its first row there, the fused tensor's
  rows), else None. Phi-3 is the one family that rotates part of each head (hf_export)."""
  parts = name.split('.')
  if not lora_fused.is_fused(model_cfg) or len(parts) < 3 or parts[-1] != 'weight' or parts[-2] not in lora_fused.FUSED:
    return None
  d, f = transformer.head_dim(model_cfg), model_cfg.ffn_hidden_size
  q, kv = model_cfg.num_attention_heads * d, param_table.kv_heads(model_cfg) * d
  first = {'q_proj': 0, 'k_proj': q, 'v_proj': q + kv, 'gate_proj': 0, 'up_proj': f}[parts[-2]]
  rows = q + 2 * kv if parts[-2] in ('q_proj', 'k_proj', 'v_proj') else 2 * f
  return to_hf_name('.'.join(parts[:-2] + [lora_fused.FUSED[parts[-2]], 'weight'])), first, rows


def file_name(name, model_cfg):
  """HF's stored name of our (non-stacked) tensor `name`; Mixtral's router lives under
  block_sparse_moe, DeepSeek-V3's shared expert is `shared_experts`."""
  hf_name = to_hf_name(name)
  if moe.enabled(model_cfg) and family(model_cfg) == 'mixtral':
    hf_name = hf_name.replace('.mlp.gate.', '.block_sparse_moe.gate.')
  if family(model_cfg) == 'deepseek_v3':       # its shared expert, plural
    hf_name = hf_name.replace('.mlp.shared_expert.', '.mlp.shared_experts.')
  if family(model_cfg) == 'llama4_text':       # its feed_forward and router
    hf_name = hf_name.replace('.mlp.gate.', '.mlp.router.').replace('.mlp.', '.feed_forward.')
  return hf_name


def transposed_stack(name, model_cfg):
  """(Llama 4's stored stack holding expert tensor `name`, which half of gate_up_proj or None
  for down_proj): [E, h, 2f] gate then up, [E, f, h] down, each ours transposed; else None."""
  if family(model_cfg) != 'llama4_text' or not moe.is_expert_param(name):
    return None
  base, kind = name.rsplit('.', 1)
  stored = file_name(base, model_cfg)
  return (stored + '.down_proj', None) if kind == 'down_proj' else (stored + '.gate_up_proj', FUSED_HALVES.index(kind))


MIXTRAL_EXPERTS = {'gate_proj': 'w1', 'up_proj': 'w3', 'down_proj': 'w2'}
FUSED_HALVES = ('gate_proj', 'up_proj')      # transformers 5's gate_up_proj: gate rows, then up rows


def expert_pieces(name, model_cfg):
  """Stacked expert tensor `name` as save_pretrained stores it: one HF tensor per expert
  (Mixtral w1 = gate, w3 = up, w2 = down; Qwen2-MoE gate/up/down_proj)."""
  layer, kind = 'model.' + name.split('.mlp.')[0], name.rsplit('.', 1)[-1]
  if family(model_cfg) == 'mixtral':
    base, part = f'{layer}.block_sparse_moe.experts', MIXTRAL_EXPERTS[kind]
  else:
    base, part = f'{layer}.mlp.experts', kind
  return [[f'{base}.{e}.{part}.weight'] for e in range(model_cfg.moe.num_experts)]


def fused_expert_stack(name):
  """(HF 5's in-memory gate_up_proj holding expert stack `name`, which half), else None."""
  base, kind = name.rsplit('.', 1)
  return (to_hf_name(base + '.gate_up_proj'), FUSED_HALVES.index(kind)) if kind in FUSED_HALVES else None


def layout(name, model_cfg, files):
  """[[HF name, ...] per expert] making up our tensor `name`: one piece for a plain tensor (or a
  stacked expert tensor stored whole, as transformers 5 holds it in memory)."""
  fused = fused_rows(name, model_cfg) or transposed_stack(name, model_cfg)
  if fused:
    return [[fused[0]]]
  if not moe.is_expert_param(name) or to_hf_name(name) in files:
    return [[file_name(name, model_cfg)]]
  fused = fused_expert_stack(name)
  if fused and fused[0] in files:
    return [[fused[0]]]
  return expert_pieces(name, model_cfg)
