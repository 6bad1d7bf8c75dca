"""The gradients' bytes per rank: the buckets they accumulate in (parallel/grad_buffer.py; 1/dp
of them under ZeRO-2, parallel/grad_shards.py) and the DP reduction's transient."""
from estimates.update_memory import bucket_bytes, largest_bucket
from model import lora
from numerics import precision
from parallel import device as devices, grad_reduce, grad_shards


def gradient_bytes(config, sizes, dp=1) -> tuple:
  """(gradient buffers, the transient during backward) in bytes, for the bucketed-buffer design:
  every trainable parameter's gradient accumulates into flat per-bucket buffers of the recipe's
  grad accumulation dtype (with ZeRO-1 each parameter's rows padded to a multiple of dp: at
  most dp - 1 rows each, not counted), and p.grad is freed once added in, so

    buffers   = sum over trainable p of numel(p) * bytes(grad acc dtype)
    transient = max over trainable p of numel(p) * bytes(param dtype)   (one p.grad)

  LoRA adapters are fp32 whatever the recipe. The same holds for the code before the buffers:
  p.grad (fp32, bf16SR) or the fp32 main grads (mixed precision) are the buffers, and adding
  a micro batch's gradient into them is the transient.

  ZeRO-2 (parallel/grad_shards.py) keeps buffers / dp, and the whole buffers it fills and
  reduces a bucket in, kept for reuse: IN_FLIGHT + 1 of the largest bucket's size (2 on gloo)."""
  recipe = precision.recipe(config.precision)
  trained = set(lora.trainable(config.model, sizes))
  grads = [v * (4 if lora.is_adapter(n) else recipe.grad_acc_dtype.itemsize) for n, v in sizes.items() if n in trained]
  transient = max((v * (4 if lora.is_adapter(n) else recipe.param_dtype.itemsize)
                   for n, v in sizes.items() if n in trained), default=0)
  if sharded_gradients(config, dp):
    whole = 2 if devices.collective_backend(config) == 'gloo' else grad_shards.IN_FLIGHT + 1
    return sum(grads) // dp + whole * largest_bucket(grads, bucket_bytes(config)), transient
  return sum(grads), transient


def sharded_gradients(config, dp) -> bool:
  """Whether ZeRO-2 (or -3) shards the gradients over `dp` ranks (each micro batch's reduced as
  it is made: distributed_strategy.grad_reduce_per_micro_batch)."""
  d = config.distributed_strategy
  return dp > 1 and d.zero1 and d.get('zero_stage', 1) >= 2 and d.get('grad_reduce_per_micro_batch', True)


def reduction_bytes(config, sizes, dp=1) -> int:
  """The DP gradient reduction's transient (parallel/grad_buffer.py). Buckets are reduced in
  place: an all-reduce (plain DP, and ZeRO-1's `all_reduce`) needs none. ZeRO-1's
  reduce-scatter (`auto`) on NCCL and XLA writes each bucket's own part to a 1/dp output until
  it is copied back (with overlap every bucket can be in flight: the gradients / dp); on gloo
  it is point to point, one bucket at a time, receiving the other ranks' copies of this rank's
  part: (dp - 1) / dp of the largest bucket."""
  d = config.distributed_strategy
  backend = devices.collective_backend(config)
  if (dp == 1 or not d.zero1 or grad_reduce.resolved(d.zero1_collectives) == 'all_reduce'
      or sharded_gradients(config, dp)):            # ZeRO-2's: in gradient_bytes' transient
    return 0
  recipe = precision.recipe(config.precision)
  trained = set(lora.trainable(config.model, sizes))
  grads = [v * recipe.grad_acc_dtype.itemsize for n, v in sizes.items() if n in trained]
  if backend == 'gloo':
    return largest_bucket(grads, bucket_bytes(config)) * (dp - 1) // dp
  return sum(grads) // dp if d.overlap_grad_reduce else largest_bucket(grads, bucket_bytes(config)) // dp
