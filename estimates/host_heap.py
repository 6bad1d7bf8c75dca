"""The CPU heap's holes in the memory estimate (estimates/memory.py): what glibc's kept heap holds
resident beside a step's live tensors where train.py keeps freed host memory, and the bound past
which a trimmed heap hands its free pages back (trim_host_heap, parallel/device.py)."""
from parallel import device as devices

# CPU with keep_freed_host_memory: the holes glibc's kept heap holds resident beside a step's live
# tensors, as a fraction of its transient bytes (activations, logits, the largest gradient): 0.2-1.6x
# measured, run to run. HEAP_HOLES_KEPT, the upper end, for a heap never trimmed (the default where
# memory is not short); HEAP_HOLES where trim_host_heap hands the free pages back near this
# estimate (host_heap_limit). CUDA has none.
HEAP_HOLES = 0.4
HEAP_HOLES_KEPT = 1.6


def heap_holes_bytes(config, transient, trimmed) -> int:
  """What the CPU heap holds resident beyond live tensors at the step's peak where train.py keeps
  freed host memory (keep_freed_host_memory, on the CPU, the environment not setting malloc
  itself: parallel/device.py): HEAP_HOLES x `transient` where it is `trimmed` near the estimate,
  else HEAP_HOLES_KEPT x. glibc serves a micro batch's tensors from the blocks the last one freed,
  which tensors of other sizes fit only in part. None elsewhere."""
  if (devices.kind(config.device) != 'cpu' or not config.get('keep_freed_host_memory', True)
      or devices.malloc_from_environment()):
    return 0
  return int((HEAP_HOLES if trimmed else HEAP_HOLES_KEPT) * transient)


def host_heap_limit(est, before_bytes) -> int:
  """The resident set past which a trimmed heap's free pages go back: the process
  before the run + its estimate - one fp32 copy of the logits (the head's burst between two checks)."""
  return before_bytes + est['total'] - est['logits'] // 2
