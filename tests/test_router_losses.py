"""model/router_losses.py: the load-balancing loss is HF's formula, and a pipeline's stages,
each adding its layers' sums to what it received, reach the one-stage losses and gradients."""
import pytest
import torch

from configs import base as base_config
from model import moe, router_losses
from tests import parity

pytest.importorskip('transformers')
# Both losses add each layer's softmax over 6 experts and its 10 tokens, over 3 layers: two
# orders of these sums (HF's, a pipeline's) differ by their fp32 round-off (parity.roundoff).
TERMS = 6 + 3 * 10


def _records(g, layers, b=2, s=10, e=6):
  return [torch.randn(b, s, e, generator=g, requires_grad=True) for _ in range(layers)]


def _cfg():
  cfg = base_config.get_config().model
  cfg.moe.update(num_experts=6, top_k=2, dropless=True, router_z_loss_coef=0.01)
  cfg.num_layers = 3
  return cfg


def test_aux_loss_with_a_mask_equals_load_balancing_loss_func():
  """Collector.losses is HF's formula; HF's attention_mask is our per-row token mask of 1s:
  checked here with the function directly, for rows of a batch one at a time."""
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
  g = torch.Generator().manual_seed(0)
  cfg = _cfg()
  logits = [torch.randn(2, 10, 6, generator=g) for _ in range(3)]
  c = router_losses.Collector(cfg, torch.ones(2), tokens=10)
  for lg in logits:
    probs, _, experts, kept = moe.route(lg, cfg)
    c.record(lg, probs, experts, kept)
  aux, _ = c.losses()
  for row in range(2):
    expected = load_balancing_loss_func(tuple(lg[row] for lg in logits), 6, 2)
    assert aux[row].item() == pytest.approx(expected.item(), rel=parity.roundoff(TERMS), abs=0)


def test_stages_passing_their_sums_on_reach_the_one_stage_losses_and_gradients():
  cfg = _cfg()
  logits = _records(torch.Generator().manual_seed(1), 3)
  w = torch.tensor([1.0, 3.0])

  def record(collector, layer):
    probs, _, experts, kept = moe.route(logits[layer], cfg)
    collector.record(logits[layer], probs, experts, kept)

  whole = router_losses.Collector(cfg, w, 10)
  for layer in range(3):
    record(whole, layer)
  ref = whole.finish(None, True, True)
  ref_grads = torch.autograd.grad(ref, logits)
  first = router_losses.Collector(cfg, w, 10, torch.zeros(2, router_losses.carry_width(cfg)))
  record(first, 0)
  assert first.finish(None, False, True) is None          # not the last stage: nothing adds here
  last = router_losses.Collector(cfg, w, 10, first.carry())
  record(last, 1)
  record(last, 2)
  tally = {}
  total = last.finish(tally, True, True)
  torch.testing.assert_close(total, ref, rtol=parity.roundoff(TERMS), atol=0)
  for got, want in zip(torch.autograd.grad(total, logits), ref_grads):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
  aux, z = whole.losses()
  torch.testing.assert_close(tally['moe_aux_loss'], (aux * w).sum().detach())
  torch.testing.assert_close(tally['moe_z_loss'], (z * w).sum().detach())


def test_full_recompute_of_a_moe_model_keeps_no_layer_s_insides_past_its_backward():
  """The recompute pass's router records are never read: kept, they held every recomputed
  layer's graph (attention scores and all) to the micro batch's end, so the step's own bytes at
  the peak grew by a layer's insides per layer (1.45 MB a layer here). Now by its saved input."""
  from configs import mixtral_tiny  # pylint: disable=import-outside-toplevel
  from data.loader import Loader  # pylint: disable=import-outside-toplevel
  from estimates import live_bytes  # pylint: disable=import-outside-toplevel
  from optim import update  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes, passes, tensor, training  # pylint: disable=import-outside-toplevel
  c = mixtral_tiny.get_config('test')
  c.data.seq_length = c.model.max_position_embeddings = 256
  c.data.micro_batch_size = c.data.global_batch_size = 1
  c.model.fusions.flash_attention, c.model.activations_checkpoint_granularity = False, 'full'

  def made_at_peak(layers):
    c.model.num_layers = layers
    mesh = meshes.init(c)
    params = training.init_params(c, mesh)
    updater = update.Updater(params, c, mesh, training.placement(c, mesh))
    with live_bytes.LiveBytes() as live:
      passes.forward_backward(params, Loader(c).global_batch(0), c, mesh, tensor.config_ops(c, mesh), updater.recipe)
    return live.at_peak['transients']

  scores = 4 * c.model.num_attention_heads * 256 * 256          # one layer's fp32 attention scores
  assert made_at_peak(6) - made_at_peak(2) < scores
