"""The start-up memory estimate."""
import math

import pytest

from configs import base, llama7b, llama_tiny
from data.loader import Loader
from estimates import host_heap, memory
from model import param_table
from numerics import precision
from optim import optimizers, update
from parallel import mesh as meshes, passes, tensor, training


def test_static_bytes_follow_the_parameter_count():
  c = llama_tiny.get_config()
  n = sum(spec.shape[0] * (spec.shape[1] if len(spec.shape) > 1 else 1)
          for spec in param_table.param_specs(c.model).values())
  est = memory.estimate(c)
  assert est['params'] == est['grads'] == 4 * n
  assert est['optimizer'] == 8 * n                     # AdamW: two fp32 moments
  c.model.optim.name = 'sgd'
  assert memory.estimate(c)['optimizer'] == 0
  assert est['total'] == est['phases'][est['peak_phase']] == max(est['phases'].values())


def test_human_bytes():
  assert memory.human_bytes(512) == '512 B'
  assert memory.human_bytes(3 * 1024**3) == '3.0 GiB'


def test_estimate_follows_the_recompute_mode():
  c = llama7b.get_config()
  kept, m = [], c.model
  for granularity, parts in ((None, ()), ('selective', ('attention',)),
                             ('selective', ('attention', 'mlp')), ('full', ())):
    m.activations_checkpoint_granularity, m.activations_checkpoint_recompute = granularity, parts
    kept.append(memory.estimate(c)['activations'])
  assert kept == sorted(kept, reverse=True) and len(set(kept)) == 4


def test_estimate_follows_the_recipe_and_zero1():
  c = llama_tiny.get_config()
  n = {'layers.0.mlp.up_proj.weight': 1000}
  fp32 = memory.estimate(c, n, dp=2)
  assert (fp32['params'], fp32['grads'], fp32['master'], fp32['optimizer']) == (4000, 4000, 0, 8000)
  c.precision.type = 'mixed_precision'
  c.distributed_strategy.zero1 = True
  mixed = memory.estimate(c, n, dp=2)
  assert (mixed['params'], mixed['grads'], mixed['master'], mixed['optimizer']) == (2000, 4000, 2000, 4000)
  c.precision.type = 'bf16SR'             # NxD's: bf16 moments, no master
  bf16 = memory.estimate(c, n, dp=2)
  assert (bf16['params'], bf16['grads'], bf16['master'], bf16['optimizer']) == (2000, 2000, 0, 2000)


@pytest.mark.parametrize('recipe', ['fp32', 'bf16SR', 'mixed_precision'])
def test_state_components_are_the_bytes_the_code_allocates(recipe):
  c = llama_tiny.get_config('test')
  c.precision.type = recipe
  mesh = meshes.Mesh()
  sizes = training.local_sizes(c, mesh)
  est = memory.estimate(c, sizes)
  params = training.init_params(c, mesh)
  assert est['params'] == sum(p.numel() * p.element_size() for p in params.values())
  updater = update.Updater(params, c, mesh, training.placement(c, mesh))
  passes.forward_backward(params, Loader(c, 'train').global_batch(0), c, mesh, tensor.config_ops(c, mesh),
                          updater.recipe)
  gradients = updater.gradients()
  assert est['grads'] == sum(g.numel() * g.element_size() for g in gradients.values())
  assert est['grad_transient'] == (max(p.numel() * p.element_size() for p in params.values())
                                   + memory.backward_working_bytes(c, 1))
  updater.step(gradients, 1e-3, 0)
  assert est['master'] + est['optimizer'] == updater.state_bytes()


def test_update_temporaries_on_cpu_are_twice_the_largest_owned_tensor():
  c = llama_tiny.get_config()
  sizes = {'a': 1000, 'b': 5000, 'c': 10}
  assert memory.update_temporaries(c, sizes) == 2 * 4 * 5000
  c.distributed_strategy.zero1 = True       # owned rows: half of each; gloo's gather is in place
  assert memory.update_temporaries(c, sizes, dp=2) == 2 * 4 * 2500
  c.device = 'cuda'                         # NCCL's all-gather goes through a bucket; CUDA's fused Adam has none
  assert memory.update_temporaries(c, sizes, dp=2) == 4 * 6010   # one bucket holds all
  c.distributed_strategy.zero1_collectives = 'all_reduce'         # the OR all-reduce is in place
  assert memory.update_temporaries(c, sizes, dp=2) == 0


@pytest.mark.parametrize('recipe', ['fp32', 'mixed_precision'])
def test_fp32_rows_of_large_parameters_step_in_place_on_cpu(recipe):
  c = llama_tiny.get_config()
  c.precision.type = recipe
  big = precision.FUSED_FP32_MIN_NUMEL
  sizes = {'a': 1000, 'b': 2 * big, 'c': 10}
  # b steps in place (one compiled pass, its norm compiled too); torch steps a: its sqrt(v) and quotient
  assert memory.fused_fp32(c) and memory.update_temporaries(c, sizes) == 2 * 4 * 1000
  c.distributed_strategy.tensor_model_parallel_size = 2      # a rank's half of b: still a large parameter
  assert memory.update_temporaries(c, {'a': 1000, 'b': big, 'c': 10}) == 2 * 4 * 1000
  c.device = 'xla'                      # torch's AdamW there: sqrt(v) and the quotient of each
  assert not memory.fused_fp32(c) and memory.update_temporaries(c, sizes) == 2 * 4 * 2 * big


def test_bf16sr_fused_update_temporaries_are_its_eager_norms():
  c = llama_tiny.get_config()
  c.precision.type = 'bf16SR'
  big = precision.FUSED_FP32_MIN_NUMEL
  sizes = {'a': 1000, 'b': 2 * big, 'c': 10}
  # b's norm compiled; a's eager (smaller than a compiled call): its fp32 copy and square
  assert memory.fused_sr(c) and memory.update_temporaries(c, sizes) == 2 * 4 * 1000
  assert memory.update_temporaries(c, {'b': 2 * big}) == 0
  c.device = 'cuda'                     # torch's multi-tensor norm there: no copies
  assert memory.fused_sr(c) and memory.update_temporaries(c, sizes) == 0
  c.precision.type = 'mixed_precision'  # ... of fp32 gradients too (the fused optimizer: none either)
  assert memory.update_temporaries(c, sizes) == 0


def test_first_pipeline_stage_holds_the_most_micro_batches():
  c = llama_tiny.get_config()
  c.distributed_strategy.pipeline_model_parallel_size = 2
  first, last = memory.estimate(c, pp_rank=0), memory.estimate(c, pp_rank=1)
  assert first['activations'] == 2 * last['activations']


def test_logits_term_is_the_fp32_log_probs_and_their_gradient():
  c = llama_tiny.get_config()
  n, v = c.data.micro_batch_size * c.data.seq_length, param_table.padded_vocab_size(c.model)
  assert memory.logits_bytes(c) == 8 * n * v
  assert memory.logits_bytes(c, tp=2) == 8 * n * param_table.padded_vocab_size(c.model, 2) // 2


def test_startup_summary_names_the_peak_phase():
  from estimates import summary  # pylint: disable=import-outside-toplevel
  c = llama_tiny.get_config()
  mesh = meshes.Mesh()
  sizes = training.local_sizes(c, mesh)
  est = memory.estimate(c, sizes)
  text = summary.startup(c, mesh, sizes, est)
  assert f'memory/rank peak (estimate): {memory.human_bytes(est["total"])} in {est["peak_phase"]}' in text


def test_memory_estimate_counts_one_chunk_of_logits():
  c = base.get_config()
  c.data.micro_batch_size, c.data.seq_length = 2, 64
  off = memory.estimate(c)['logits']
  c.model.fusions.chunked_cross_entropy = 16
  on = memory.estimate(c)['logits']
  assert off - on == 2 * 4 * (2 * 64 - 16) * param_table.padded_vocab_size(c.model, 1)
  c.model.fusions.chunked_cross_entropy = 4096          # longer than the micro batch: no change
  assert memory.estimate(c)['logits'] == off


def test_moe_estimate_counts_every_expert_and_a_share_of_them_under_expert_parallelism():
  """All E experts per rank at ep1; 1/ep of them at ep (the routers and the rest whole), as
  training.local_sizes holds them."""
  from configs import mixtral_tiny  # pylint: disable=import-outside-toplevel
  from model import moe  # pylint: disable=import-outside-toplevel
  c = mixtral_tiny.get_config()
  specs = param_table.param_specs(c.model)
  experts = sum(math.prod(s.shape) for n, s in specs.items() if moe.is_expert_param(n))
  one = memory.estimate(c)
  c.distributed_strategy.expert_model_parallel_size = 2
  two = memory.estimate(c)
  assert one['params'] == 4 * param_table.count_params(c.model) + 4 * (param_table.padded_vocab_size(c.model)
                                                                     - c.model.vocab_size) * 2 * c.model.hidden_size
  assert one['params'] - two['params'] == 4 * experts // 2
  mesh = meshes.Mesh(dp=2, ep=2, rank=1)
  sizes = training.local_sizes(c, mesh)
  assert sum(v for n, v in sizes.items() if moe.is_expert_param(n)) == experts // 2


def test_heap_holes_are_counted_where_train_py_keeps_freed_host_memory(monkeypatch):
  for k in ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_', 'MALLOC_MMAP_MAX_', 'MALLOC_TOP_PAD_', 'LD_PRELOAD',
            'GLIBC_TUNABLES'):
    monkeypatch.delenv(k, raising=False)
  c = llama_tiny.get_config()
  est = memory.estimate(c)                                   # auto: untrimmed unless memory is short
  transient = est['activations'] + est['logits'] + est['grad_transient']
  assert est['heap_holes'] == int(host_heap.HEAP_HOLES_KEPT * transient) > 0
  assert 0 < est['logits_apart'] == min(est['logits'], memory.backward_working_bytes(c, 1))
  assert est['phases']['forward_backward'] == (est['params'] + est['optimizer'] + est['runtime'] + est['grads']
                                               + transient - est['logits_apart'] + est['heap_holes'])
  c.trim_host_heap = False                                   # the holes of every micro batch stay resident
  assert memory.estimate(c) == est
  c.trim_host_heap = True                                    # trimmed near the estimate: fewer holes counted
  trimmed = memory.estimate(c)
  assert trimmed['heap_holes'] == int(host_heap.HEAP_HOLES * transient) < est['heap_holes']
  assert memory.with_heap_trimmed(c, est) == trimmed
  assert trimmed['total'] == est['total'] - est['heap_holes'] + trimmed['heap_holes']
  c.trim_host_heap = 'auto'
  monkeypatch.setenv('MALLOC_MMAP_THRESHOLD_', '65536')      # the environment's malloc: train.py keeps nothing
  assert memory.estimate(c)['heap_holes'] == 0
  monkeypatch.delenv('MALLOC_MMAP_THRESHOLD_')
  c.keep_freed_host_memory = False
  assert memory.estimate(c)['heap_holes'] == 0
  c.keep_freed_host_memory, c.device = True, 'cuda'          # the allocated peak holds no holes
  assert memory.estimate(c)['heap_holes'] == 0
