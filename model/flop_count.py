"""Training FLOPs per token: what MFU, the planner and the benchmarks divide by."""
from model import moe, transformer


def flops_per_token(cfg, seq_length: int) -> float:
  """Training FLOPs per token, PaLM/torchtitan convention: 6 N_nonembedding + 12 L h s.

  N_nonembedding excludes the input embedding table but keeps the LM head (for tied
  embeddings the one table is the LM head and counts). Attention counted non-causal. With
  LoRA the frozen base needs no weight gradients: 4 FLOPs per frozen parameter, 6 per trained.
  MoE counts active parameters: of each MoE layer's experts, the top_k a token runs.
  """
  n, trained = transformer.count_params(cfg, embedding=False), transformer.count_params(cfg, embedding=False, trainable_only=True)
  if moe.enabled(cfg):        # a token runs top_k of the experts: active parameters only
    full = trained == n       # else LoRA: the experts are frozen (adapters never target them)
    n -= moe.inactive_params(cfg)
    trained = n if full else trained
  return 6 * trained + 4 * (n - trained) + 12 * cfg.num_layers * cfg.hidden_size * seq_length
