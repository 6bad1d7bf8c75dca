"""estimates/grad_memory.py: the gradient buckets' bytes (1/dp under ZeRO-2, with the whole
buffers it keeps) and the DP reduction's transient per backend."""
from configs import llama_tiny
from estimates import grad_memory
from parallel import grad_shards


def test_zero1_reduction_buffers_per_backend():
  c = llama_tiny.get_config()
  c.bucket_size_collectives = 20000 / 2**20             # bytes: buckets (a, b) and (c)
  sizes = {'a': 1000, 'b': 4000, 'c': 10}               # fp32 gradients: 4,000, 16,000, 40 bytes
  assert grad_memory.reduction_bytes(c, sizes, dp=4) == 0    # plain DP all-reduces in place
  c.distributed_strategy.zero1 = True
  # gloo, point to point: one bucket at a time receives the other ranks' 3/4 of it
  assert grad_memory.reduction_bytes(c, sizes, dp=4) == 20000 * 3 // 4
  c.device = 'cuda'                                     # NCCL: every bucket's 1/dp output in flight
  assert grad_memory.reduction_bytes(c, sizes, dp=4) == (4000 + 16000 + 40) // 4
  c.distributed_strategy.zero1_collectives = 'all_reduce'
  assert grad_memory.reduction_bytes(c, sizes, dp=4) == 0


def test_zero2_keeps_a_dp_share_of_the_buffers_and_the_buckets_in_flight():
  c = llama_tiny.get_config()
  c.bucket_size_collectives = 20000 / 2**20             # bytes: buckets (a, b) and (c)
  sizes = {'a': 1000, 'b': 4000, 'c': 10}
  full, transient = grad_memory.gradient_bytes(c, sizes, dp=4)
  assert full == 4 * 5010 and transient == 4 * 4000     # one p.grad at a time
  c.distributed_strategy.zero1, c.distributed_strategy.zero_stage = True, 2
  assert grad_memory.gradient_bytes(c, sizes, dp=4) == (full // 4 + 2 * 20000, transient)     # gloo: 2 whole
  assert grad_memory.reduction_bytes(c, sizes, dp=4) == 0
  c.device = 'cuda'
  assert grad_memory.gradient_bytes(c, sizes, dp=4)[0] == full // 4 + (grad_shards.IN_FLIGHT + 1) * 20000
  assert grad_memory.gradient_bytes(c, sizes, dp=1) == (full, transient)     # nothing to shard over
