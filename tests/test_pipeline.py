"""Pipeline stages and the executor: every pipeline layout trains exactly like one device."""
import pytest

from configs import validate
from parallel import mesh as meshes, pipeline
from tests import parity

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
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_layout_trains_like_one_device(layout, tmp_path, tmp_path_factory):
  world_size, kwargs = LAYOUTS[layout]
  parity.check_layout(layout, world_size, kwargs, tmp_path, tmp_path_factory)


def test_microbatches_fewer_than_stages_do_not_hang(tmp_path, tmp_path_factory):
  layout = {'pp': 4, 'layers': 4, 'micro': 4}
  config = parity.parity_config(**layout)
  assert config.data.global_batch_size // config.data.micro_batch_size == 2   # m = 2 < p = 4
  parity.check_layout('pp4_m2', 4, layout, tmp_path, tmp_path_factory)


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
