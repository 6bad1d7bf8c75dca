"""gpt-oss's tensors in HF files <-> ours (the rest of its tensors are named as ours plus `model.`).

transformers 5 holds, and save_pretrained writes, each MoE layer as
  mlp.router.weight [E, h], mlp.router.bias [E]        ours: mlp.gate.weight, mlp.gate.bias
  mlp.experts.gate_up_proj [E, h, 2f]                   ours: experts.gate_proj, up_proj [E, f, h]:
      gate and up interleaved (gate the even columns)         transposed, de-interleaved
  mlp.experts.gate_up_proj_bias [E, 2f] (interleaved)   ours: experts.gate_proj_bias, up_proj_bias [E, f]
  mlp.experts.down_proj [E, f, h]                       ours: experts.down_proj [E, h, f] (transposed)
  mlp.experts.down_proj_bias [E, h]                     the same
OpenAI's released checkpoints hold the two expert weights in MXFP4 instead: `<w>_blocks`
[E, out, in / 32, 16] uint8 (two 4-bit E2M1 values a byte, the low nibble first) and
`<w>_scales` [E, out, in / 32] uint8 (a power of two, biased by 127, per 32 values), rows in our
[out, in] orientation (gate_up_proj's rows interleaved). Import dequantizes them; every MXFP4
value is exact in bf16 and fp32, so nothing is rounded. Export writes transformers' unquantized
layout.
"""
import torch

# E2M1: the 16 values of a 4-bit code (sign, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FUSED = {'gate_proj': 0, 'up_proj': 1}          # column (or row) parity in gate_up_proj
OURS = ('.mlp.gate.weight', '.mlp.gate.bias', '.experts.gate_proj', '.experts.up_proj', '.experts.gate_proj_bias',
        '.experts.up_proj_bias', '.experts.down_proj')


def is_renamed(name) -> bool:
  """Whether our tensor `name` is held differently in gpt-oss's files (else: `model.` + name)."""
  return name.endswith(OURS)


def hf_names(name, quantized) -> list:
  """The HF tensors holding our `name` (`quantized`: the file holds MXFP4 blocks and scales)."""
  layer, _, rest = name.partition('.mlp.')
  base = f'model.{layer}.mlp.'
  if rest.startswith('gate.'):
    return [base + 'router.' + rest.split('.')[-1]]
  kind = rest.split('.')[-1]
  if kind.endswith('_bias'):
    return [base + 'experts.gate_up_proj_bias']
  stored = base + ('experts.down_proj' if kind == 'down_proj' else 'experts.gate_up_proj')
  return [stored + '_blocks', stored + '_scales'] if quantized else [stored]


def quantized(files) -> bool:
  return any(n.endswith('.experts.gate_up_proj_blocks') for n in files)


def expected_shape(hf_name, cfg):
  """The shape gpt-oss's files hold for one of its renamed tensors."""
  e, h = cfg.moe.num_experts, cfg.hidden_size
  f = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size
  kind = hf_name.rsplit('.', 1)[-1]
  return {'weight': (e, h), 'bias': (e,), 'gate_up_proj': (e, h, 2 * f), 'gate_up_proj_bias': (e, 2 * f),
          'down_proj': (e, f, h), 'gate_up_proj_blocks': (e, 2 * f, h // 32, 16), 'gate_up_proj_scales': (e, 2 * f, h // 32),
          'down_proj_blocks': (e, h, f // 32, 16), 'down_proj_scales': (e, h, f // 32)}[kind]


def dequantize(blocks, scales, dtype=torch.float32):
  """MXFP4 [..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values."""
  lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
  values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
  values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
  return values.flatten(-2).to(dtype)


def read(name, box, read_slice, quant):
  """Our tensor `name`'s `box` from gpt-oss's files; `read_slice(hf_name, box)` reads a box of a
  stored tensor; `quant`: the expert weights are MXFP4."""
  kind = name.rsplit('.', 1)[-1]
  layer, _, _ = name.partition('.mlp.')
  base = f'model.{layer}.mlp.'
  if name.endswith(('.gate.weight', '.gate.bias')):
    return read_slice(base + 'router.' + kind, box)
  if kind.endswith('_bias'):                    # [E, f] of the interleaved [E, 2f]
    half = FUSED[kind[:-len('_bias')]]
    return read_slice(base + 'experts.gate_up_proj_bias', (box[0], _pairs(box[1])))[:, half::2]
  if kind == 'down_proj':                      # ours [E, h, f]; stored [E, f, h] or MXFP4 rows h
    if quant:
      whole = _dequantized(read_slice, base + 'experts.down_proj', (box[0], box[1]))
      return whole[:, :, box[2]]
    return read_slice(base + 'experts.down_proj', (box[0], box[2], box[1])).transpose(1, 2)
  half = FUSED[kind]                           # ours [E, f, h]
  if quant:
    whole = _dequantized(read_slice, base + 'experts.gate_up_proj', (box[0], _pairs(box[1])))
    return whole[:, half::2, box[2]]
  return read_slice(base + 'experts.gate_up_proj', (box[0], box[2], _pairs(box[1])))[:, :, half::2].transpose(1, 2)


def _pairs(rows):
  """Rows [a, b) of gate (or up) -> the interleaved rows [2a, 2b) holding them and their partners."""
  return slice(2 * rows.start, 2 * rows.stop)


def _dequantized(read_slice, stored, box):
  return dequantize(read_slice(stored + '_blocks', box), read_slice(stored + '_scales', box))


def to_hf(params, layer_prefix):
  """HF tensors of one MoE layer `layer_prefix` ('layers.N') from ours (whole, on the CPU)."""
  p, out = layer_prefix + '.mlp.', {}
  base = 'model.' + p
  out[base + 'router.weight'], out[base + 'router.bias'] = params[p + 'gate.weight'], params[p + 'gate.bias']
  gate, up = params[p + 'experts.gate_proj'], params[p + 'experts.up_proj']
  out[base + 'experts.gate_up_proj'] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
  out[base + 'experts.gate_up_proj_bias'] = torch.stack(
      [params[p + 'experts.gate_proj_bias'], params[p + 'experts.up_proj_bias']], dim=2).flatten(1)
  out[base + 'experts.down_proj'] = params[p + 'experts.down_proj'].transpose(1, 2).contiguous()
  return out
