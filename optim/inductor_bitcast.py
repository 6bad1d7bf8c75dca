"""Vector bit casts for inductor's CPU kernels while optim/sr_update.py's kernels compile.

Stochastic rounding reads an fp32 value's bits and writes bits back as fp32 (`x.view(int32)`,
`bits.view(float32)`): two bit casts per rounding, six per bf16SR element. Inductor's C++
backend (torch 2.9-2.13) has no vector form of a bit cast: it stores each vector to a stack
array, casts element by element and reloads (`CppVecOverrides._scalarize`), which stalls store
forwarding and cost half of the fused update (32M elements, 1 thread: 134 ms with, 66 ms
without; nearest rounding 27 ms). ATen's `at::vec::cast<dst>(Vectorized<src>)` is that bit
cast on whole registers, for any ISA the header supports.

`vector_bitcasts()` swaps the override in for the kernels compiled inside it and puts the
original back after, so nothing else in the process (model.compile, user code) is touched. A
bit cast is a bit cast: the kernels' results are the same bits with or without it
(tests/test_sr_update.py checks compiled == eager bit for bit). Where inductor's internals
differ from what this expects (another torch), it does nothing and the kernels run as before.
"""
import contextlib
import functools
import logging


def _vector_bitcast(original, cpp, virtualized):
  def to_dtype_bitcast(x, dtype, src_dtype):
    if dtype.itemsize != src_dtype.itemsize:          # a widening reinterpretation: not ours
      return original(x, dtype, src_dtype)
    vectors = virtualized.V.kernel._get_num_vectors(dtype)  # pylint: disable=protected-access
    dst = cpp.DTYPE_TO_CPP[dtype]
    if vectors == 1:
      return f'at::vec::cast<{dst}>({x})'
    return (f'([&]() {{ at::vec::VectorizedN<{dst}, {vectors}> r; '
            f'for (int i = 0; i < {vectors}; i++) r[i] = at::vec::cast<{dst}>({x}[i]); return r; }})()')
  return staticmethod(to_dtype_bitcast)


@functools.lru_cache(maxsize=None)
def _parts():
  """(CppVecOverrides, cpp module, virtualized module), or None where they are not as expected
  (looked up once: vector_bitcasts wraps every fused update call of a step)."""
  try:
    from torch._inductor.codegen import cpp  # pylint: disable=import-outside-toplevel
    from torch._inductor import virtualized  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  overrides = getattr(cpp, 'CppVecOverrides', None)
  if (overrides is None or 'to_dtype_bitcast' not in vars(overrides) or not hasattr(cpp, 'DTYPE_TO_CPP')
      or not hasattr(getattr(cpp, 'CppVecKernel', None), '_get_num_vectors')):
    logging.debug('inductor_bitcast: this torch has no CppVecOverrides.to_dtype_bitcast to replace')
    return None
  return overrides, cpp, virtualized


@contextlib.contextmanager
def vector_bitcasts():
  """Inside: inductor's CPU vector kernels bit-cast same-size dtypes in registers."""
  parts = _parts()
  if parts is None:
    yield
    return
  overrides, cpp, virtualized = parts
  original = vars(overrides)['to_dtype_bitcast']
  overrides.to_dtype_bitcast = _vector_bitcast(original.__func__, cpp, virtualized)
  try:
    yield
  finally:
    overrides.to_dtype_bitcast = original
