"""parallel/experts.py: expert parallelism and experts split over TP train like one device
(fp32, 10 steps, capacity dropping and the auxiliary losses on), with ZeRO-1, SP and PP; the
all-to-all round trip; a step saved at ep2 resumes at ep1."""
import os

import pytest
import torch

from model import moe_kernels
from parallel import comm, experts, mesh as meshes
from tests import parity, world

LAYOUTS = {                        # name: (world size, parity_config kwargs)
    'ep2': (2, dict(moe=4, ep=2)),
    'ep2_zero1': (2, dict(moe=4, ep=2, zero1=True)),
    'dp4_ep2_zero1': (4, dict(moe=4, ep=2, zero1=True)),
    'ep2_dropless': (2, dict(moe=4, ep=2, capacity=0)),
    'tp2': (2, dict(moe=4, tp=2)),                  # each expert split over TP (gate / up / down on f)
    'tp2_sp': (2, dict(moe=4, tp=2, sp=True)),
    'tp2_dropless': (2, dict(moe=4, tp=2, capacity=0)),
    'ep2_tp2': (4, dict(moe=4, ep=2, tp=2)),
    # the traced path (XLA, model.compile): fixed-size expert buffers, exchanged whole over EP
    'ep2_fixed': (2, dict(moe=4, ep=2, fixed_buffers=True)),
    'ep2_tp2_sp_fixed': (4, dict(moe=4, ep=2, tp=2, sp=True, fixed_buffers=True)),
    'ep2_pp2_dropless_fixed': (4, dict(moe=4, ep=2, pp=2, capacity=0, fixed_buffers=True)),
    'ep2_tp2_sp': (4, dict(moe=4, ep=2, tp=2, sp=True)),
    # the auxiliary losses through the pipeline: their sums travel with the activations
    'pp2': (2, dict(moe=4, pp=2)),
    'pp2_vp2': (2, dict(moe=4, pp=2, vp=2, layers=4)),                            # interleaved 1F1B
    'pp2_tp2': (4, dict(moe=4, pp=2, tp=2)),
    'ep2_pp2_zero1': (4, dict(moe=4, ep=2, pp=2, zero1=True)),
    'ep2_pp2_vp2': (4, dict(moe=4, ep=2, pp=2, vp=2, layers=4)),
    # LoRA on every linear of the attention (MoE layers take none; experts frozen), and SFT's
    # packed rows with masked prompts (tests/test_train.py's records), each at ep2 x zero1
    'ep2_lora': (2, dict(moe=4, ep=2, zero1=True, lora=4)),
    'ep2_sft': (2, dict(moe=4, ep=2, zero1=True, sft='records')),
}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_expert_parallel_layouts_train_like_one_device(world_size, tmp_path, tmp_path_factory):
  """The layouts of one world size, one after another in one spawned world."""
  from tests.test_train import write_records  # pylint: disable=import-outside-toplevel
  layouts = parity.of_size(LAYOUTS, world_size)
  for name, (size, kwargs) in layouts.items():
    if kwargs.get('sft') == 'records':
      layouts[name] = size, dict(kwargs, sft=write_records(tmp_path_factory.mktemp('sft') / 'records.jsonl', 64))
  parity.check_layouts(layouts, tmp_path, tmp_path_factory)


def _exchange(rank_inputs):
  import os  # pylint: disable=import-outside-toplevel
  from configs import base  # pylint: disable=import-outside-toplevel
  c = base.get_config()
  c.distributed_strategy.expert_model_parallel_size = 2
  mesh = meshes.init(c, 'cpu')
  rank = int(os.environ['RANK'])
  x = rank_inputs[rank].clone().requires_grad_()
  counts = [1, 2, 0, 3] if rank == 0 else [2, 1, 1, 2]    # 4 experts, 2 per rank
  gate = torch.ones(2, 2, 2)          # [2 experts here, f, h]; rank r's experts scaled by 1 + r
  down = torch.ones(2, 2, 2)
  ffn = experts.expert_ffn(mesh.ep_group, 2)
  scale = 1 + mesh.ep_rank
  y = ffn(x, counts, moe_kernels.Experts(gate * scale, gate * scale, down * scale))
  y.sum().backward()
  return y.detach(), x.grad


def test_all_to_all_round_trip_matches_local_experts():
  """Each rank's tokens come back in order, through the experts the other rank holds too."""
  inputs = [torch.randn(6, 2, generator=torch.Generator().manual_seed(r)) for r in range(2)]
  results = world.run(_exchange, 2, inputs)
  gate = down = torch.cat([torch.ones(2, 2, 2), 2 * torch.ones(2, 2, 2)])
  for r, counts in enumerate(([1, 2, 0, 3], [2, 1, 1, 2])):
    x = inputs[r].clone().requires_grad_()
    expected = moe_kernels.local_expert_ffn(x, counts, moe_kernels.Experts(gate, gate, down))
    expected.sum().backward()
    torch.testing.assert_close(results[r][0], expected.detach())
    torch.testing.assert_close(results[r][1], x.grad)


def test_boxes_and_groups():
  m = meshes.Mesh(dp=4, ep=2, rank=3)
  assert (m.ep_rank, m.expert_dp, m.expert_dp_rank) == (1, 2, 1)
  spec = type('S', (), {'shape': (8, 3, 2)})
  assert experts.ep_box('layers.0.mlp.experts.down_proj', (slice(0, 8), slice(0, 3), slice(0, 2)), spec, m)[0] \
      == slice(4, 8)
  assert experts.ep_box('layers.0.mlp.gate.weight', (slice(0, 8),), spec, m)[0] == slice(0, 8)
  assert experts.domain(m, 'layers.0.mlp.experts.down_proj', True)[1:] == (2, 1)
  assert experts.domain(m, 'layers.0.mlp.gate.weight', True)[1:] == (4, 3)


def test_a_step_saved_at_ep2_resumes_bitwise_at_ep2_and_continues_at_ep1(tmp_path):
  """Checkpoints are layout-free: each expert box is stored once, in its global place."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tests.test_session import _resume_from, _run, losses  # pylint: disable=import-outside-toplevel
  ep2, ep1 = dict(moe=4, ep=2, zero1=True), dict(moe=4)
  # each resume runs first in a fresh world; the uninterrupted runs beside them
  world.run(world.in_turn, 2, [(_run, (str(tmp_path / 'straight_ep2'), ep2, 0)), (_run, (str(tmp_path / 'saved'), ep2, 10))])
  saved = str(tmp_path / 'saved' / 'checkpoints' / 'step_00000010')
  world.run(_run, 2, str(tmp_path / 'saved'), ep2, 0)                 # resumes there, at ep2
  assert losses(tmp_path / 'saved') == losses(tmp_path / 'straight_ep2')   # identical floats
  os.makedirs(tmp_path / 'ep1')
  world.run(world.in_turn, 1, [(_resume_from, (str(tmp_path / 'ep1'), ep1, saved)),
                               (_run, (str(tmp_path / 'straight_ep1'), ep1, 0))])
  np.testing.assert_allclose(losses(tmp_path / 'ep1'), losses(tmp_path / 'straight_ep1')[10:], rtol=1e-5)


def _stop_rank_1_then_dispatch(timeout_s):
  import signal  # pylint: disable=import-outside-toplevel
  c = parity.parity_config(moe=4, ep=2)
  c.distributed_strategy.collective_timeout_s = timeout_s
  mesh = meshes.init(c)
  if mesh.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # a stopped peer (killed by world.run afterwards)
  stack = torch.ones(2, 2, 2)
  experts.expert_ffn(mesh.ep_group, 2)(torch.ones(4, 2), [1, 1, 1, 1], moe_kernels.Experts(stack, stack, stack))


def test_a_stopped_rank_fails_the_expert_all_to_all_naming_rank_and_operation():
  with pytest.raises(RuntimeError, match=r'rank 0: all_to_all\(tokens per expert\) over ranks \[0, 1\] failed'):
    world.run(_stop_rank_1_then_dispatch, 2, 3, timeout=90)
