"""Pipeline stages and the executor: every pipeline layout trains exactly like one device."""
import numpy as np
import pytest
import torch

from configs import validate
from parallel import mesh as meshes, pipeline
from tests import parity, world

LAYOUTS = {
    'pp2': (2, {'pp': 2, 'layers': 4}),
    'pp4': (4, {'pp': 4, 'layers': 4}),
    'pp2_v2_interleaved': (2, {'pp': 2, 'vp': 2, 'layers': 4}),
    'pp2_uneven_cuts': (2, {'pp': 2, 'cuts': (1,), 'layers': 4}),
    'pp2_tied_embeddings': (2, {'pp': 2, 'layers': 4, 'tied': True}),
    'tp2_pp2_dp2_sp': (8, {'tp': 2, 'sp': True, 'pp': 2, 'layers': 4}),
    'pp2_gemma3_lora': (2, {'pp': 2, 'layers': 4, 'family': 'gemma3', 'lora': 4}),   # layer types per stage
    # Mistral's sliding windows with Qwen2's q/k/v biases (and Llama 3.1's RoPE scaling) over stages
    'pp2_mistral_qwen2_llama3_rope': (2, {'pp': 2, 'layers': 4, 'family': 'mistral', 'qkv_bias': True,
                                          'rope_llama3': True}),
    'pp4_m2': (4, {'pp': 4, 'layers': 4, 'micro': 4}),     # micro batches fewer than stages: no hang
}


@pytest.mark.parametrize('world_size', parity.world_sizes(LAYOUTS))
def test_layouts_train_like_one_device(world_size, tmp_path, tmp_path_factory):
  """The layouts of one world size, one after another in one spawned world."""
  parity.check_layouts(parity.of_size(LAYOUTS, world_size), tmp_path, tmp_path_factory)


def test_microbatches_fewer_than_stages_are_among_the_layouts():
  """pp4_m2 (trained above) must not hang: 2 micro batches for 4 stages."""
  config = parity.parity_config(**LAYOUTS['pp4_m2'][1])
  assert config.data.global_batch_size // config.data.micro_batch_size == 2   # m = 2 < p = 4


def test_stage_bounds_even_remainder_and_cuts():
  assert pipeline.stage_bounds(8, 2) == [(0, 4), (4, 8)]
  assert pipeline.stage_bounds(7, 2) == [(0, 3), (3, 7)]          # remainder to the later stage
  assert pipeline.stage_bounds(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
  assert pipeline.stage_bounds(8, 2, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
  assert pipeline.stage_bounds(8, 2, cuts=(3,)) == [(0, 3), (3, 8)]


def test_owned_names_follow_the_stages():
  cfg = parity.parity_config(layers=4).model
  bounds = pipeline.stage_bounds(4, 2, 2)
  first = pipeline.owned_names(cfg, meshes.Mesh(pp=2, rank=0), bounds, 2)
  last = pipeline.owned_names(cfg, meshes.Mesh(pp=2, rank=1), bounds, 2)
  layer = lambda names: sorted({int(n.split('.')[1]) for n in names if n.startswith('layers.')})
  assert layer(first) == [0, 2] and layer(last) == [1, 3]           # virtual stages 0, 2 and 1, 3
  assert 'embed_tokens.weight' in first and 'embed_tokens.weight' not in last
  assert 'lm_head.weight' in last and 'norm.weight' in last and 'norm.weight' not in first
  cfg.share_embeddings_and_output_weights = True
  assert 'embed_tokens.weight' in pipeline.owned_names(cfg, meshes.Mesh(pp=2, rank=1), bounds, 2)


def test_pipeline_config_errors():
  c = parity.parity_config(pp=2, cuts=(1, 2), layers=4)
  assert any('pipeline_cuts=(1, 2) must be pp x virtual - 1 = 1' in p for p in validate.check(c, 2))
  c = parity.parity_config(vp=2, layers=4)
  assert any('needs pipeline_model_parallel_size > 1' in p for p in validate.check(c, 1))
  c = parity.parity_config(pp=2, vp=2, layers=6)
  assert any('not divisible by pp x virtual = 4' in p for p in validate.check(c, 2))


def test_a_deallocated_output_keeps_its_backward_and_drops_its_values():
  x = torch.randn(4, 8, requires_grad=True)
  w = torch.randn(8, 8)
  y = torch.tanh(x @ w) + x                 # the stage's last op, like the residual add
  grad = torch.randn(4, 8)
  expected, = torch.autograd.grad(y, x, grad, retain_graph=True)
  pipeline.deallocate(y)
  assert y.shape == (4, 8) and y.untyped_storage().nbytes() == y.element_size()
  torch.autograd.backward(y, grad_tensors=grad)
  torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


DEALLOCATED_LAYOUTS = ({'pp': 2, 'layers': 4}, {'pp': 2, 'vp': 2, 'layers': 4})


def _two_steps():
  """For each layout, with and without deallocation: this rank's parameters after two steps
  and how many outputs were deallocated."""
  out, real = [], pipeline.deallocate
  try:
    for layout in DEALLOCATED_LAYOUTS:
      for deallocate_outputs in (False, True):
        config = parity.parity_config(**layout)
        config.distributed_strategy.deallocate_pipeline_outputs = deallocate_outputs
        freed = []
        pipeline.deallocate = lambda t, freed=freed: freed.append(t.shape) or real(t)
        out.append((parity.steps_on_rank(config, 2), len(freed)))
  finally:
    pipeline.deallocate = real
  return out


def test_deallocate_pipeline_outputs_frees_every_sent_output_and_changes_no_value():
  ranks = world.run(_two_steps, 2)
  for i, layout in enumerate(DEALLOCATED_LAYOUTS):
    config = parity.parity_config(**layout)
    microbatches, chunks = config.data.global_batch_size // config.data.micro_batch_size, layout.get('vp', 1)
    kept = [r[2 * i] for r in ranks]
    freed = [r[2 * i + 1] for r in ranks]
    # every forward output but the last virtual stage's is sent, then freed
    assert [n for _, n in freed] == [2 * microbatches * chunks, 2 * microbatches * (chunks - 1)], layout
    assert [n for _, n in kept] == [0, 0]
    for (a, _), (b, _) in zip(kept, freed):
      for name, value in a.items():
        np.testing.assert_array_equal(b[name], value, err_msg=f'{name} {layout}')


def test_a_message_carries_activations_and_an_fp32_carry_both_ways():
  """pack / unpack: fp32 exactly; in bf16 the carry as hi + lo (~16 significant bits, not 8);
  the gradients of both come back through the one message."""
  g = torch.Generator().manual_seed(0)
  x, carry = torch.randn(2, 3, 4, generator=g), torch.rand(2, 9, generator=g) * 1e4
  for dtype, carry_rtol in ((torch.float32, 0.0), (torch.bfloat16, 2.0 ** -15)):
    xs, cs = x.to(dtype).detach().requires_grad_(), carry.clone().requires_grad_()
    message = pipeline.pack(xs, cs)
    assert message.dtype == dtype and message.numel() == pipeline.message_numel(x.shape, carry.shape, dtype)
    received = message.detach().requires_grad_()
    x2, c2 = pipeline.unpack(received, x.shape, carry.shape)
    assert torch.equal(x2, xs) and c2.dtype == torch.float32
    assert ((c2 - carry).abs() <= carry_rtol * carry).all(), dtype
    (x2.float().sum() * 3 + (c2 * 2).sum()).backward()
    message.backward(received.grad)
    assert torch.equal(xs.grad, torch.full_like(xs, 3)) and torch.equal(cs.grad, torch.full_like(cs, 2))
