"""Chunked cross-entropy: the LM head and the per-token loss run over chunks of tokens, so no
more than one chunk's logits ever exist, in the forward or in the backward.

The unchunked head keeps a micro batch's logits [b, s, V/t] for backward: in the compute
dtype, their fp32 copy, and in backward the fp32 gradient and its compute-dtype cast. At a
Llama-3 vocabulary (128,256) that is the largest activation of the model. Here the forward
computes each chunk's logits and per-token loss and keeps only the head's input x [N, h] (in
the compute dtype, as F.linear would) and the weight; the backward recomputes each chunk's
logits and loss, takes the loss's gradient w.r.t. that chunk's logits from the same op
(`ops.cross_entropy`: local, or vocab-parallel with its max and sums all-reduced over TP), and
turns it into the chunk's rows of dL/dx and its share of dL/dW.

Why recompute instead of computing the gradients in the forward (Liger's fused linear CE):
the objectives return per-token losses that they combine however they like (masked sums,
DPO's per-pair sums of log-probs under a sigmoid), so the upstream gradient is per token and
only known in backward; and a forward-time dL/dW would hold a head-sized fp32 buffer from
forward to backward (2 GiB at V = 128k, h = 4096). The price is one more head matmul and one
more loss pass per token (the head's cost goes from 3 to 4 matmuls), and under TP the loss's
three small all-reduces ([chunk] floats each) run again in backward.

Exactness: every token's loss, dL/dlogits and dL/dx are the unchunked op's own (same kernels
on the same rows); dL/dW is summed over chunks, so it differs from one matmul in rounding
only. With a 16-bit compute dtype that sum runs in fp32 (a W-sized fp32 buffer during the
head's backward), so chunking adds no 16-bit rounding.
"""
import typing

import torch


class HeadInput(typing.NamedTuple):
  """What the objective gets in place of logits when the loss is chunked."""
  x_bsh: torch.Tensor       # the final norm's output, whole (after ops.full_input)
  weight_vh: torch.Tensor   # this rank's vocab rows of the head (the embedding table when tied)
  chunk_tokens: int         # tokens per chunk (model.fusions.chunked_cross_entropy)


def token_losses(head_out, labels_bs, cfg, ops):
  """Per-token cross-entropy [b, s] (fp32) of logits, or of a HeadInput chunk by chunk."""
  if isinstance(head_out, HeadInput):
    return chunked_cross_entropy(head_out.x_bsh, head_out.weight_vh, labels_bs, cfg.vocab_size, ops,
                                 head_out.chunk_tokens)
  return ops.cross_entropy(head_out, labels_bs, cfg.vocab_size)


def chunked_cross_entropy(x_bsh, weight_vh, labels_bs, vocab_size, ops, chunk_tokens):
  """ops.cross_entropy(ops.lm_head(x_bsh, weight_vh), labels_bs, vocab_size), `chunk_tokens`
  tokens (of the flattened b * s) at a time, forward and backward."""
  if chunk_tokens < 1:
    raise ValueError(f'model.fusions.chunked_cross_entropy={chunk_tokens}: chunks need at least one token '
                     '(0 turns chunking off before this point)')
  return _ChunkedCrossEntropy.apply(x_bsh, weight_vh, labels_bs, vocab_size, ops, chunk_tokens)


def compute_dtype(x, w):
  """The dtype F.linear(x, w) computes in here: autocast's when it is on for this device."""
  kind = x.device.type
  if torch.is_autocast_enabled(kind):
    return torch.get_autocast_dtype(kind)
  return torch.promote_types(x.dtype, w.dtype)


def _spans(n, chunk):
  return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


class _ChunkedCrossEntropy(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x_bsh, weight_vh, labels_bs, vocab_size, ops, chunk):  # pylint: disable=arguments-differ
    dtype = compute_dtype(x_bsh, weight_vh)
    # Cast once (autocast would cast the weight again per chunk), then run without autocast:
    # the same values autocast's F.linear computes.
    x = x_bsh.reshape(-1, x_bsh.shape[-1]).to(dtype)
    w = weight_vh.to(dtype)
    labels = labels_bs.reshape(-1)
    with torch.autocast(x.device.type, enabled=False):
      losses = [ops.cross_entropy(ops.lm_head(x[span][None], w), labels[span][None], vocab_size)[0]
                for span in _spans(x.shape[0], chunk)]
    ctx.save_for_backward(x, weight_vh, labels)
    ctx.vocab_size, ctx.ops, ctx.chunk, ctx.x_shape, ctx.x_dtype = vocab_size, ops, chunk, x_bsh.shape, x_bsh.dtype
    return torch.cat(losses).view(labels_bs.shape)

  @staticmethod
  def backward(ctx, grad_bs):  # pylint: disable=arguments-differ
    x, weight_vh, labels = ctx.saved_tensors
    ops, want_x, want_w = ctx.ops, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    w = weight_vh.to(x.dtype)
    grad = grad_bs.reshape(-1)
    grad_x = torch.empty(x.shape, dtype=ctx.x_dtype, device=x.device) if want_x else None
    # dL/dW summed over chunks in fp32 at least: 16-bit sums would round once per chunk
    acc_dtype = torch.promote_types(weight_vh.dtype, torch.float32)
    grad_w = torch.zeros(weight_vh.shape, dtype=acc_dtype, device=x.device) if want_w else None
    with torch.autocast(x.device.type, enabled=False):
      for span in _spans(x.shape[0], ctx.chunk):
        logits = ops.lm_head(x[span][None], w).detach().requires_grad_()
        with torch.enable_grad():
          loss = ops.cross_entropy(logits, labels[span][None], ctx.vocab_size)
        d_logits = torch.autograd.grad(loss, logits, grad[span][None])[0][0]   # [n, V/t], compute dtype
        if want_x:
          grad_x[span] = (d_logits @ w).to(ctx.x_dtype)
        if want_w:
          if acc_dtype == x.dtype:
            grad_w.addmm_(d_logits.t(), x[span])
          else:
            grad_w += (d_logits.t() @ x[span]).to(acc_dtype)
    return (grad_x.view(ctx.x_shape) if want_x else None,
            grad_w.to(weight_vh.dtype) if want_w else None, None, None, None, None)
