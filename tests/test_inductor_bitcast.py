"""optim/inductor_bitcast.py: inductor's CPU kernels bit-cast in vector registers inside
vector_bitcasts(), give the same bits as eager, and the override is put back after."""
import pytest
import torch
from torch._inductor import config as inductor_config, cpu_vec_isa
from torch._inductor.codegen import cpp
from torch._inductor.utils import run_and_get_code

from optim import inductor_bitcast


def _bit_games(x):
  bits = x.view(torch.int32) + 0x7FFF & -(1 << 16)
  return bits.view(torch.float32) * 2


def _compiled_code(x):
  torch._dynamo.reset()
  with inductor_config.patch(fx_graph_cache=False):
    out, code = run_and_get_code(torch.compile(_bit_games, dynamic=True), x)
  return out, '\n'.join(code)


@pytest.mark.skipif(not cpu_vec_isa.pick_vec_isa(), reason='inductor writes no vector code here (a CPU without '
                    'AVX2 / AVX-512 / NEON, or ATEN_CPU_CAPABILITY=default)')
def test_bit_casts_stay_in_vector_registers_and_give_eager_bits():
  x = torch.randn(1003) * torch.exp2(torch.arange(1003) % 80 - 40.0)
  original = vars(cpp.CppVecOverrides)['to_dtype_bitcast']
  with inductor_bitcast.vector_bitcasts():
    out, code = _compiled_code(x)
  assert 'at::vec::cast<int32_t>' in code and 'at::vec::cast<float>' in code
  assert torch.equal(out.view(torch.int32), _bit_games(x).view(torch.int32))
  assert vars(cpp.CppVecOverrides)['to_dtype_bitcast'] is original
  _, plain = _compiled_code(x)                        # outside: inductor's own codegen
  assert 'at::vec::cast<int32_t>' not in plain
