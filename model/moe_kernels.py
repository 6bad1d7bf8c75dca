"""The experts' SwiGLU itself, on tokens already dispatched: stacked expert tensors [E, f, h]
(`Experts`: with gpt-oss's per-expert gate / up biases and clamped SwiGLU where the model has
them) applied to tokens sorted by expert (grouped GEMM where torch has one, else a matmul triple per
expert) or to fixed-size per-expert buffers (batched matmuls), in float8 with precision.fp8's
gemms. Routing, capacity and the dispatch around these kernels stay in model/moe.py; they live
apart because parallel/experts.py runs the same kernels on the tokens an all-to-all brought in,
and estimates/activations.py asks the grouped GEMM's fit rule without building a model.
"""
import typing
from typing import Optional

import torch
import torch.nn.functional as F

import host_values
from numerics import fp8


class Experts(typing.NamedTuple):
  """One MoE layer's experts as a rank holds them (its experts under EP, its f columns under TP).
  The down projection's bias is not here: model/moe.py adds it after the TP reduction."""
  gate: torch.Tensor                          # [E, f, h]
  up: torch.Tensor                            # [E, f, h]
  down: torch.Tensor                          # [E, h, f]
  gate_bias: Optional[torch.Tensor] = None    # [E, f] (gpt-oss)
  up_bias: Optional[torch.Tensor] = None      # [E, f]
  clamp: tuple = ()                           # gpt-oss's (alpha, limit): the clamped SwiGLU below

  def glu(self, g, u):
    """SwiGLU silu(g) u, or gpt-oss's: g clamped above at limit, u to [-limit, limit],
    (u + 1) g sigmoid(alpha g)."""
    if not self.clamp:
      return F.silu(g) * u
    alpha, limit = self.clamp
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def _biased(y, bias, rows):
  """y [T, f] plus each row's expert's bias (`rows`: the expert of each row, or None when y is [E, R, f])."""
  if bias is None:
    return y
  return y + (bias[:, None, :] if rows is None else bias.index_select(0, rows))


def local_expert_ffn(x_th, counts, experts: Experts, gemms=None):
  """Tokens sorted by expert (`counts` per expert, a list) through their experts' SwiGLU: one
  grouped GEMM per projection where the build has one for these tensors (torch._grouped_mm:
  exact against per-expert matmuls), else one matmul triple per expert (in float8 with
  precision.fp8's `gemms`, each expert its own scales)."""
  w = experts
  if gemms is None and _grouped_mm_fits(x_th, w.gate, w.down):
    offs = torch.tensor(counts, device=x_th.device).cumsum(0).to(torch.int32)
    rows = None
    if w.gate_bias is not None:     # each row's expert, for its bias
      rows = torch.arange(len(counts), device=x_th.device).repeat_interleave(
          torch.tensor(counts, device=x_th.device), output_size=x_th.shape[0])
    mm = lambda a, b: torch._grouped_mm(a, b.transpose(1, 2), offs=offs)   # pylint: disable=protected-access
    hidden = w.glu(_biased(mm(x_th, w.gate), w.gate_bias, rows), _biased(mm(x_th, w.up), w.up_bias, rows))
    return mm(hidden, w.down)
  outs = []
  for chunk, one in zip(x_th.split(counts), _each(w)):
    if chunk.shape[0]:
      outs.append(_one_expert(chunk, *one, w.glu, gemms))
  return torch.cat(outs) if outs else x_th[:0]


def _each(w):
  """(gate, up, down, gate bias, up bias) per expert: the stacks unbound once (indexing them per
  expert would make each expert's backward write a whole-stack gradient: E^2 traffic)."""
  biases = (w.gate_bias.unbind(0), w.up_bias.unbind(0)) if w.gate_bias is not None else ((None,) * len(w.gate),) * 2
  return zip(w.gate.unbind(0), w.up.unbind(0), w.down.unbind(0), *biases)


def _one_expert(x, gate, up, down, gate_bias, up_bias, glu, gemms):
  """One expert's SwiGLU on its tokens x [T, h] (in float8 with precision.fp8's `gemms`)."""
  column, row = (gemms['column'], gemms['row']) if gemms else (None, None)
  g, u = fp8.linear(x, gate, gemms=column), fp8.linear(x, up, gemms=column)
  if gate_bias is not None:
    g, u = g + gate_bias, u + up_bias
  return fp8.linear(glu(g, u), down, gemms=row)



def grouped_mm_fits(h, f, dtype, device_type) -> bool:
  """Whether torch._grouped_mm (CPU in recent torch; CUDA) runs experts of width f on h:
  fp32 or bf16, rows of 16-byte multiples (its alignment rule)."""
  per_row = 16 // dtype.itemsize
  return (hasattr(torch, '_grouped_mm') and device_type in ('cpu', 'cuda') and dtype in (torch.float32, torch.bfloat16)
          and h % per_row == 0 and f % per_row == 0)


def _grouped_mm_fits(x, gate_efh, down_ehf) -> bool:
  if host_values.is_fake(x) and x.dtype != torch.bfloat16:    # the fake kernel takes bf16 only (CUDA's rule)
    host_values.note('MoE: fp32 experts run one matmul triple per expert (the grouped GEMM\'s fake kernel is bf16 only)')
    return False
  return (not torch.compiler.is_compiling() and gate_efh.dtype == x.dtype == down_ehf.dtype and x.is_contiguous()
          and grouped_mm_fits(x.shape[-1], gate_efh.shape[1], x.dtype, x.device.type))


def grouped_expert_ffn(buffers_erh, experts: Experts, gemms=None):
  """Each expert's SwiGLU on its buffer: batched matmuls, [E, R, h] -> [E, R, h] (in float8 with
  `gemms`: an expert at a time, each its own scales)."""
  w = experts
  if gemms:
    return torch.stack([_one_expert(x, *one, w.glu, gemms) for x, one in zip(buffers_erh.unbind(0), _each(w))])
  hidden = w.glu(_biased(torch.bmm(buffers_erh, w.gate.transpose(1, 2)), w.gate_bias, None),
                 _biased(torch.bmm(buffers_erh, w.up.transpose(1, 2)), w.up_bias, None))
  return torch.bmm(hidden, w.down.transpose(1, 2))
