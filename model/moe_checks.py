"""Checks of the model.moe section and of the layouts MoE can run under: the problems
configs/validate.py and model/checks.py collect before anything is built, kept apart from
model/moe.py's forward so that validating a config reads as a list of rules and the forward
module holds only what runs.
"""
from config_checks import one_of, positive
from model.moe import enabled

ROUTING = ('top_k',)
ACTIVATIONS = ('softmax', 'sigmoid')
EXPERT_ACTIVATIONS = ('swiglu', 'clamped_swiglu')


def check(model) -> list:
  """Problems with model.moe."""
  problems = []
  if not enabled(model):
    if model.get('moe') and model.moe.num_experts < 0:
      problems.append(f'model.moe.num_experts={model.moe.num_experts} must be >= 0 (0 = dense)')
    return problems
  moe = model.moe
  positive(problems, 'model.moe.frequency', moe.frequency)
  outside = [i for i in moe.get('dense_layers', ()) if not 0 <= i < model.num_layers]
  if outside:
    problems.append(f'model.moe.dense_layers has {outside}, outside the model\'s layers 0-{model.num_layers - 1}')
  positive(problems, 'model.moe.top_k', moe.top_k)
  if moe.top_k > moe.num_experts:
    problems.append(f'model.moe.top_k={moe.top_k} > model.moe.num_experts={moe.num_experts}')
  if moe.routing_algorithm == 'sinkhorn':
    problems.append('model.moe.routing_algorithm=sinkhorn is not implemented (its exact NxD form is not '
                    'reproduced here); use top_k')
  else:
    one_of(problems, 'model.moe.routing_algorithm', moe.routing_algorithm, ROUTING)
  one_of(problems, 'model.moe.router_activation', moe.router_activation, ACTIVATIONS)
  if moe.dropout:
    problems.append(f'model.moe.dropout={moe.dropout} is not implemented (expert dropout); set 0.0')
  if not moe.dropless:
    positive(problems, 'model.moe.capacity_factor', moe.capacity_factor)
  positive(problems, 'model.moe.router_aux_loss_coef', moe.router_aux_loss_coef, allow_zero=True)
  positive(problems, 'model.moe.router_z_loss_coef', moe.router_z_loss_coef, allow_zero=True)
  positive(problems, 'model.moe.ffn_hidden_size', moe.ffn_hidden_size, allow_zero=True)
  positive(problems, 'model.moe.shared_expert_intermediate_size', moe.shared_expert_intermediate_size,
           allow_zero=True)
  if model.activation != 'swiglu':
    problems.append(f'model.moe: experts are SwiGLU; model.activation={model.activation!r} is not supported with '
                    'num_experts > 0')
  one_of(problems, 'model.moe.expert_activation', moe.get('expert_activation', 'swiglu'), EXPERT_ACTIVATIONS)
  if moe.get('num_groups', 1) > 1 and (moe.num_experts % moe.num_groups or not
                                       0 < moe.top_k_groups <= moe.num_groups):
    problems.append(f'model.moe.num_groups={moe.num_groups} must divide num_experts={moe.num_experts}, and '
                    f'top_k_groups={moe.top_k_groups} be 1..num_groups')
  if moe.get('expert_activation') == 'clamped_swiglu':
    positive(problems, 'model.moe.swiglu_limit', moe.swiglu_limit)
  positive(problems, 'model.moe.load_balance_rate', moe.get('load_balance_rate', 0.0), allow_zero=True)
  if moe.get('load_balance_rate', 0.0) and not moe.get('load_balance_bias'):
    problems.append(f'model.moe.load_balance_rate={moe.load_balance_rate} moves the correction bias, which '
                    'model.moe.load_balance_bias=False leaves out; set load_balance_bias=True or the rate to 0')
  if moe.get('load_balance_rate', 0.0) and model.compile:
    problems.append('model.moe.load_balance_rate > 0 with model.compile=True: the per-layer loads are not '
                    'counted inside compiled blocks yet; set model.compile=False')
  if moe.get('load_balance_rate', 0.0) and model.peft.lora_rank > 0:
    problems.append('model.moe.load_balance_rate > 0 with LoRA: the moving biases would not be in the adapter '
                    'checkpoints; set the rate to 0 (the biases stay as loaded)')
  if model.has_bias and moe.shared_expert_intermediate_size:
    problems.append('model.has_bias with model.moe.shared_expert_intermediate_size: the shared expert\'s biases '
                    'are not built (routed experts and router have them: gpt-oss); set has_bias=False')
  return problems


def check_layout(model, strategy) -> list:
  """Layouts MoE cannot run under (distributed_strategy degrees already > 0)."""
  problems = []
  ep = strategy.get('expert_model_parallel_size', 1)
  if not enabled(model):
    if ep > 1:
      problems.append(f'distributed_strategy.expert_model_parallel_size={ep} needs model.moe.num_experts > 0')
    return problems
  if model.moe.num_experts % ep:
    problems.append(f'model.moe.num_experts={model.moe.num_experts} is not divisible by '
                    f'distributed_strategy.expert_model_parallel_size={ep}')
  return problems
