"""The experts' SwiGLU itself, on tokens already dispatched: stacked expert tensors [E, f, h]
applied to tokens sorted by expert (grouped GEMM where torch has one, else a matmul triple per
expert) or to fixed-size per-expert buffers (batched matmuls), in float8 with precision.fp8's
gemms. Routing, capacity and the dispatch around these kernels stay in model/moe.py; they live
apart because parallel/experts.py runs the same kernels on the tokens an all-to-all brought in,
and estimates/activations.py asks the grouped GEMM's fit rule without building a model.
"""
import torch
import torch.nn.functional as F

import host_values
from numerics import fp8


def local_expert_ffn(x_th, counts, gate_efh, up_efh, down_ehf, gemms=None):
  """Tokens sorted by expert (`counts` per expert, a list) through their experts' SwiGLU: one
  grouped GEMM per projection where the build has one for these tensors (torch._grouped_mm:
  exact against per-expert matmuls), else one matmul triple per expert (in float8 with
  precision.fp8's `gemms`, each expert its own scales). The stacks are unbound once: indexing
  them per expert would make each expert's backward write a whole-stack gradient (E^2 traffic)."""
  if gemms is None and _grouped_mm_fits(x_th, gate_efh, down_ehf):
    offs = torch.tensor(counts, device=x_th.device).cumsum(0).to(torch.int32)
    hidden = F.silu(torch._grouped_mm(x_th, gate_efh.transpose(1, 2), offs=offs)) * \
        torch._grouped_mm(x_th, up_efh.transpose(1, 2), offs=offs)   # pylint: disable=protected-access
    return torch._grouped_mm(hidden, down_ehf.transpose(1, 2), offs=offs)   # pylint: disable=protected-access
  outs = []
  for chunk, gate, up, down in zip(x_th.split(counts), gate_efh.unbind(0), up_efh.unbind(0), down_ehf.unbind(0)):
    if chunk.shape[0]:
      outs.append(_swiglu(chunk, gate, up, down, gemms))
  return torch.cat(outs) if outs else x_th[:0]


def _swiglu(x, gate, up, down, gemms):
  column, row = (gemms['column'], gemms['row']) if gemms else (None, None)
  return fp8.linear(F.silu(fp8.linear(x, gate, gemms=column)) * fp8.linear(x, up, gemms=column), down, gemms=row)



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


def grouped_expert_ffn(buffers_erh, gate_efh, up_efh, down_ehf, gemms=None):
  """Each expert's SwiGLU on its buffer: batched matmuls, [E, R, h] -> [E, R, h] (in float8 with
  `gemms`: an expert at a time, each its own scales)."""
  if gemms:
    return torch.stack([_swiglu(*parts, gemms) for parts in zip(buffers_erh.unbind(0), gate_efh.unbind(0),
                                                                 up_efh.unbind(0), down_ehf.unbind(0))])
  hidden = F.silu(torch.bmm(buffers_erh, gate_efh.transpose(1, 2))) * torch.bmm(buffers_erh, up_efh.transpose(1, 2))
  return torch.bmm(hidden, down_ehf.transpose(1, 2))
