"""A CPU-sized Mixtral: llama_tiny's attention with 8 SwiGLU experts per layer, top-2 routing.

Each expert is half llama_tiny's MLP wide (176 = 352 / 2), so a token's two experts cost what
llama_tiny's one MLP does: the two models have equal active FLOPs (but the router's 8 x h).

    python train.py --config=configs/mixtral_tiny.py --workdir=runs/mixtral_tiny
    python -m tools.bench --config=configs/mixtral_tiny.py --compare_moe   # vs dense and transformers
"""
from configs import llama_tiny, presets


def get_config(arg=None):
  c = llama_tiny.get_config()
  c.name = 'mixtral_tiny'
  c.model.architecture = 'mixtral'
  c.model.ffn_hidden_size = 176
  c.model.moe.update(num_experts=8, top_k=2, capacity_factor=2.0, dropless=False,
                     router_aux_loss_coef=0.02, output_router_logits=True)
  return presets.apply(c, arg, 'mixtral_tiny', test=_test)


def _test(c):
  c = llama_tiny._test(c)  # pylint: disable=protected-access
  c.model.ffn_hidden_size = 32
  c.model.moe.num_experts = 4
  return c
