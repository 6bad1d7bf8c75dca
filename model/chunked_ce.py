"""Chunked cross-entropy: the LM head and the per-token loss run over chunks of tokens, so no
more than one chunk's logits ever exist, in the forward or in the backward.

The unchunked head keeps a micro batch's logits [b, s, V/t] for backward (in fp32: the
log-softmax, or the logits' fp32 copy under TP), and its backward makes two to three more
copies (the gradient, the sliced-off padding's zeros, the compute-dtype cast). At a Llama-3
vocabulary (128,256) that is the largest activation of the model. Here the forward computes
each chunk's logits, their fp32 max and sum of exp (all-reduced over the vocab shards, TP,
exactly as parallel/tensor.py's vocab_parallel_cross_entropy) and the loss, and keeps only the
head's input x [N, h] (in the compute dtype, as F.linear would), the weight, and two fp32
numbers per token. The backward recomputes each chunk's logits and turns them in place into
dL/dlogits = g (exp(z - lse) - onehot), then into the chunk's rows of dL/dx and its share of dL/dW.
Peak: one chunk's logits in the compute dtype plus (16-bit only) their fp32 copy.

Why recompute instead of computing the gradients in the forward (Liger's fused linear CE):
the objectives return per-token losses that they combine however they like (masked sums,
DPO's per-pair sums of log-probs under a sigmoid), so the upstream gradient g is per token and
only known in backward; and a forward-time dL/dW would hold a head-sized fp32 buffer from
forward to backward (2 GiB at V = 128k, h = 4096). The price is one more head matmul per token
(the head's cost goes from 3 to 4 matmuls) and one more exp pass; the backward needs no
collective (the max and sum come from the forward).

Exactness: the loss is vocab_parallel_cross_entropy's formula, log sum exp(z - max) - (z_label
- max); dL/dW is summed over chunks, so it differs from one matmul in rounding only. With a
16-bit compute dtype that sum runs in fp32 (a W-sized fp32 buffer during the head's backward),
so chunking adds no 16-bit rounding. Nothing here is specific to a device (no CPU/CUDA calls).
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


def _chunk_logits(x_nh, w_vh, vocab_size, ops):
  """fp32 logits of a chunk [n, V/t], padded vocab rows at -inf: a fresh tensor, free to
  modify in place."""
  z = ops.lm_head(x_nh, w_vh)
  z = z.float() if z.dtype != torch.float32 else z
  width = z.shape[-1]
  padded_from = vocab_size - ops.vocab_rank * width     # this shard's first padded column, if any
  if padded_from < width:
    z[:, max(padded_from, 0):] = float('-inf')
  return z


def _label_columns(labels_n, width, ops):
  """Each label's column in this shard, and whether this shard holds it."""
  local = labels_n - ops.vocab_rank * width
  mine = (local >= 0) & (local < width)
  return local.clamp(0, width - 1)[:, None], mine


class _ChunkedCrossEntropy(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x_bsh, weight_vh, labels_bs, vocab_size, ops, chunk):  # pylint: disable=arguments-differ
    dtype = compute_dtype(x_bsh, weight_vh)
    # Cast once (autocast would cast the weight again for every chunk), then run without
    # autocast: the values autocast's F.linear computes.
    x = x_bsh.reshape(-1, x_bsh.shape[-1]).to(dtype)
    w = weight_vh.to(dtype)
    labels = labels_bs.reshape(-1)
    tops, sums, label_logits = [], [], []
    with torch.autocast(x.device.type, enabled=False):
      for span in _spans(x.shape[0], chunk):
        z = _chunk_logits(x[span], w, vocab_size, ops)
        column, mine = _label_columns(labels[span], z.shape[-1], ops)
        picked = torch.where(mine, z.gather(-1, column).squeeze(-1), torch.zeros((), device=z.device))
        top = ops.vocab_reduce(z.max(dim=-1).values, 'max')
        sum_exp = z.sub_(top[:, None]).exp_().sum(dim=-1)
        tops.append(top)
        sums.append(sum_exp)
        label_logits.append(picked)
        del z
    top, sum_exp, picked = torch.cat(tops), torch.cat(sums), torch.cat(label_logits)
    both = ops.vocab_reduce(torch.stack([sum_exp, picked]), 'sum')    # one collective for the two sums
    sum_exp, label_logit = both[0], both[1]
    ctx.save_for_backward(x, weight_vh, labels, top, sum_exp)
    ctx.vocab_size, ctx.ops, ctx.chunk, ctx.x_shape, ctx.x_dtype = vocab_size, ops, chunk, x_bsh.shape, x_bsh.dtype
    return (sum_exp.log() - (label_logit - top)).view(labels_bs.shape)

  @staticmethod
  def backward(ctx, grad_bs):  # pylint: disable=arguments-differ
    x, weight_vh, labels, top, sum_exp = ctx.saved_tensors
    ops, want_x, want_w = ctx.ops, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    w = weight_vh.to(x.dtype)
    grad = grad_bs.reshape(-1).float()
    lse = top + sum_exp.log()
    grad_x = torch.empty(x.shape, dtype=ctx.x_dtype, device=x.device) if want_x else None
    # dL/dW summed over chunks in fp32 at least: 16-bit sums would round once per chunk
    acc_dtype = torch.promote_types(weight_vh.dtype, torch.float32)
    grad_w = torch.zeros(weight_vh.shape, dtype=acc_dtype, device=x.device) if want_w else None
    with torch.autocast(x.device.type, enabled=False):
      for span in _spans(x.shape[0], ctx.chunk):
        p = _chunk_logits(x[span], w, ctx.vocab_size, ops)
        p.sub_(lse[span, None]).exp_()                                       # softmax
        column, mine = _label_columns(labels[span], p.shape[-1], ops)
        p.scatter_add_(-1, column, -mine.to(p.dtype)[:, None])              # - onehot(label)
        d_logits = p.mul_(grad[span, None]).to(x.dtype)
        del p
        if want_x:
          grad_x[span] = (d_logits @ w).to(ctx.x_dtype)
        if want_w:
          if acc_dtype == x.dtype:
            grad_w.addmm_(d_logits.t(), x[span])
          else:
            grad_w += (d_logits.t() @ x[span]).to(acc_dtype)
        del d_logits
    return (grad_x.view(ctx.x_shape) if want_x else None,
            grad_w.to(weight_vh.dtype) if want_w else None, None, None, None, None)
