"""Training FLOPs per token: what MFU, the planner and the benchmarks divide by."""
from model import lora, moe, param_table, transformer


def attention_spans(cfg, seq_length: int) -> list:
  """Keys each layer's queries attend to, as the FLOPs count them: the whole sequence for a
  full-attention layer, at most the window for a sliding one, the chunk for a chunked one."""
  window = min(cfg.get('sliding_window') or seq_length, seq_length)
  chunk = min(cfg.get('attention_chunk_size') or seq_length, seq_length)
  span = {'sliding_attention': window, 'chunked_attention': chunk}
  return [span.get(kind, seq_length) for kind in transformer.layer_types(cfg)]


def flops_per_token(cfg, seq_length: int) -> float:
  """Training FLOPs per token, PaLM/torchtitan convention: 6 N_nonembedding + the attention's
  12 x heads x head_dim x span, summed over the layers (span: seq_length, or min(sliding_window,
  seq_length) on a sliding-window layer).

  N_nonembedding excludes the input embedding table but keeps the LM head (for tied
  embeddings the one table is the LM head and counts). The attention term is QK^T and PV,
  forward and backward (3 x 2 x 2 FLOPs per query-key pair per head dimension), over
  heads x head_dim (which need not equal hidden_size: Gemma 3 270M's 4 x 256 against 640),
  counted non-causal as torchtitan does. With LoRA the frozen base needs no weight gradients:
  4 FLOPs per frozen parameter, 6 per trained. MoE counts active parameters: of each MoE
  layer's experts, the top_k a token runs.
  """
  n, trained = param_table.count_params(cfg, embedding=False), param_table.count_params(cfg, embedding=False, trainable_only=True)
  if moe.enabled(cfg):        # a token runs top_k of the experts: active parameters only
    full = lora.settings(cfg) is None    # else LoRA: the experts are frozen (adapters never target them)
    n -= moe.inactive_params(cfg)
    trained = n if full else trained
  attention = 12 * cfg.num_attention_heads * transformer.head_dim(cfg) * sum(attention_spans(cfg, seq_length))
  return 6 * trained + 4 * (n - trained) + attention
