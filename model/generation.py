"""Text generation on one device: prefill, then one token at a time through the KV cache.

Sampling is keyed like every other draw: token t of a generation seeded `seed` comes from
rng.generator(seed, 'sample', t), so a run is reproduced exactly. temperature 0 is greedy.
"""
import dataclasses

import torch

import rng
from model import transformer


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0     # 0: greedy (argmax)
  top_k: int = 0               # keep the k most likely tokens (0: all)
  top_p: float = 1.0           # keep the smallest set whose probability reaches p (1: all)
  seed: int = 0


def next_token(logits_v, sampling: Sampling, step: int) -> int:
  """One token from the logits [V] of the last position."""
  if sampling.temperature <= 0:
    return int(logits_v.argmax())
  logits = logits_v.float() / sampling.temperature
  if sampling.top_k > 0:
    kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
    logits = logits.masked_fill(logits < kth, float('-inf'))
  if sampling.top_p < 1.0:
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the tokens before it already reach top_p (the first always stays)
    drop = probs.cumsum(-1) - probs >= sampling.top_p
    logits = logits.index_fill(0, order[drop], float('-inf'))
  probs = torch.softmax(logits, dim=-1)
  return int(torch.multinomial(probs.cpu(), 1, generator=rng.generator(sampling.seed, 'sample', step)))


@torch.no_grad()
def generate(params, cfg, prompt_ids, max_new_tokens, sampling=Sampling(), stop_ids=()):
  """Token ids that continue `prompt_ids` (a list), at most `max_new_tokens`, ending at (and
  including) the first id in `stop_ids`."""
  device = next(iter(params.values())).device
  tokens = torch.tensor([prompt_ids], device=device)
  logits, cache = transformer.decode(params, tokens, cfg)
  out = []
  for step in range(max_new_tokens):
    token = next_token(logits[0, -1, :cfg.vocab_size], sampling, step)
    out.append(token)
    learned_positions_end = (cfg.position_embedding_type == 'learned_absolute'
                             and len(prompt_ids) + len(out) >= cfg.max_position_embeddings)
    if token in stop_ids or learned_positions_end:
      break
    if _crosses_to_long_factors(cfg, cache.length, len(prompt_ids) + len(out)):
      logits, cache = transformer.decode(params, torch.tensor([prompt_ids + out], device=device), cfg)
      continue
    logits, cache = transformer.decode(params, torch.tensor([[token]], device=device), cfg, cache)
  return out


def _crosses_to_long_factors(cfg, past, total) -> bool:
  """Whether longrope's frequencies switch to the long factors as the sequence grows from
  `past` to `total` positions: then the cached keys, rotated with the short ones, are recomputed
  (as transformers' Phi-3 drops its cache there), not kept."""
  scaling = cfg.get('rope_scaling')
  if scaling is None or scaling.type != 'longrope':
    return False
  return past <= scaling.original_max_position_embeddings < total
