"""The parameters' bytes per rank: whole boxes, or under ZeRO-3 (parallel/param_shards.py) the
owned rows plus the layers gathered around the one that runs; and ZeRO's shard count (HSDP)."""
import math

from model import lora, moe
from numerics import precision


def zero_parts(config, dp) -> int:
  """How many ranks ZeRO shards a dense parameter over: dp x cp, or under HSDP
  distributed_strategy.data_parallel_shard_size (1 without ZeRO)."""
  d = config.distributed_strategy
  if not d.zero1:
    return 1
  return d.get('data_parallel_shard_size', 0) or dp * d.get('context_parallel_size', 1)


def parts_of(config, name, dp) -> int:
  """ZeRO's shard count of parameter `name`: experts over the DP ranks holding them (dp / ep)."""
  d = config.distributed_strategy
  if moe.is_expert_param(name) and d.get('expert_model_parallel_size', 1) > 1:
    return dp // d.expert_model_parallel_size if d.zero1 else 1
  return zero_parts(config, dp)


def sharded_params(config, dp) -> bool:
  d = config.distributed_strategy
  return d.zero1 and d.get('zero_stage', 1) == 3 and zero_parts(config, dp) > 1


def param_bytes(config, sizes, dp=1) -> tuple:
  """(held from init on, one layer gathered whole, the final norm and head gathered whole, layers
  gathered at once) in bytes for `sizes` (name -> elements this rank's boxes hold). Without
  ZeRO-3 every box is held whole and nothing is gathered. Under ZeRO-3 a rank holds 1 / parts of
  each box (its rows, parts_of), and whole during the passes: the final norm and head from the end
  of the forward through the backward, and up to three layers in the backward (the one running,
  the one above not yet freed, the one below prefetched; the forward holds two); with
  reshard_after_forward or reshard_after_backward False every layer of the stage. The embedding is gathered for the lookup
  only, before any activation exists: not counted."""
  recipe = precision.recipe(config.precision)
  width = lambda n: 4 if lora.is_adapter(n) else recipe.param_dtype.itemsize   # pylint: disable=unnecessary-lambda-assignment
  if not sharded_params(config, dp):
    return sum(v * width(n) for n, v in sizes.items()), 0, 0, 0
  held = sum(math.ceil(v / parts_of(config, n, dp)) * width(n) for n, v in sizes.items())
  shared = {n: v * width(n) for n, v in sizes.items() if parts_of(config, n, dp) > 1}
  units = {n.split('.')[1] for n in shared if n.startswith('layers.')}
  d = config.distributed_strategy
  # an even share of the model names every layer at 1/pp of its size: the stage's layers hold it
  layers = len(units) if len(units) < config.model.num_layers else \
      math.ceil(config.model.num_layers / d.pipeline_model_parallel_size)
  per_layer = sum(v for n, v in shared.items() if n.startswith('layers.')) / max(layers, 1)
  head = sum(v for n, v in shared.items() if not n.startswith(('layers.', 'embed_')))
  if config.model.share_embeddings_and_output_weights:
    head += shared.get('embed_tokens.weight', 0)
  whole = not (d.get('reshard_after_forward', True) and d.get('reshard_after_backward', True))
  kept = layers if whole else min(3, layers)
  return held, int(per_layer), head, kept


def gathered_bytes(config, sizes, dp) -> int:
  """ZeRO-3's whole boxes counted at the forward-backward peak: the head and the layers gathered
  in the backward (param_bytes). Where the peak falls, at the logits or later in the backward
  beside the whole gradient buckets, depends on the shapes: both are counted (an upper bound by
  at most the layers; the traced dry run shows which)."""
  _, per_layer, head, kept = param_bytes(config, sizes, dp)
  return head + kept * per_layer
