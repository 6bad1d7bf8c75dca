"""estimates/summary.py's planner cluster for the start-up summary (the summary's text itself is
checked where each feature adds to it: tests/test_step_time.py, test_memory.py, test_context.py)."""
import dataclasses

import torch

from configs import llama_tiny
from estimates import clusters, summary


def test_a_cpu_process_is_its_threads_worth_of_local_devices(tmp_path, monkeypatch):
  """--calibrate measures one thread; a process of n threads has n times its rates, and the same
  framework overhead and collectives (one Python thread, one process pair)."""
  entry = dataclasses.replace(clusters.LOCAL_DEFAULT, peak={'fp32': 1e11, 'bf16': 5e9}, mem_bw=4e10, ew_bw=1e10,
                              logit_s=8e-9, layer_overhead=6e-4, op_times={'p2p': [[8, 1e-4], [4e6, 3e-3]]})
  monkeypatch.setenv('FLATRON_CLUSTER_FILE', clusters.write_local(entry, str(tmp_path / 'local.json')))
  monkeypatch.setattr(torch, 'get_num_threads', lambda: 4)
  got = summary.plan_cluster(llama_tiny.get_config(), torch.device('cpu'))
  assert got == dataclasses.replace(entry, peak={'fp32': 4e11, 'bf16': 2e10}, mem_bw=1.6e11, ew_bw=4e10,
                                    logit_s=2e-9)


def test_a_dry_run_judges_the_device_of_the_cluster_plan_cluster_names():
  from configs import llama3_70b, validate  # pylint: disable=import-outside-toplevel
  c = llama3_70b.get_config()
  d = c.distributed_strategy
  d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.sequence_parallel = 32, 8, True
  c.data.global_batch_size, c.model.activations_checkpoint_granularity = 256, 'full'
  c.trainer.plan_cluster = 'trn1.32xlarge'
  text, refusal = summary.dry_run_report(c, 512, validate.check)
  assert refusal is None
  assert 'memory: fits a trn1.32xlarge device: ' in text and ' of 16.0 GiB' in text
  assert '512 devices, 16 trn1.32xlarge nodes' in text

  d.tensor_model_parallel_size, d.pipeline_model_parallel_size, d.sequence_parallel = 4, 1, True
  text, refusal = summary.dry_run_report(c, 4, validate.check)
  assert refusal.startswith('does not fit a trn1.32xlarge device: this run needs an estimated ')
  assert 'but a rank has 16.0 GiB (a trn1.32xlarge device)' in refusal and 'no layout of 4 process(es) fits' in refusal
  assert f'memory: {refusal}' in text

  c.trainer.memory_check = False
  text, refusal = summary.dry_run_report(c, 4, validate.check)
  assert refusal is None and 'memory: does not fit a trn1.32xlarge device: ' in text and 'not refused' in text
  c.trainer.memory_check = True

  c.trainer.plan_cluster = 'none'        # no target: this machine is reported on, never a refusal
  text, refusal = summary.dry_run_report(c, 4, validate.check)
  assert refusal is None and 'memory: would be refused here: ' in text


def test_a_dry_run_for_a_gpu_cluster_estimates_its_attention_kernels():
  """Latent attention keeps its s x s probabilities only where torch runs it on the math path (the
  CPU): a dry run judged on H100s estimates the fused kernel, what those devices run."""
  from configs import deepseek_v3, validate  # pylint: disable=import-outside-toplevel
  from estimates import memory  # pylint: disable=import-outside-toplevel
  from parallel import mesh as meshes, training  # pylint: disable=import-outside-toplevel
  c = deepseek_v3.get_config('smoke')
  c.data.seq_length, c.trainer.plan_cluster, c.model.activations_checkpoint_granularity = 512, 'h100', None
  text, _ = summary.dry_run_report(c, 1, validate.check)
  sizes = training.local_sizes(c, meshes.Mesh(device=torch.device('cpu')))
  here, there = memory.estimate(c, sizes, 1), c.copy_and_resolve_references()
  there.device = 'cuda'
  gpu = memory.on_another_device(memory.estimate(there, sizes, 1))
  assert gpu['activations'] < here['activations']                    # no kept probabilities
  assert f'activations {memory.human_bytes(gpu["activations"])}' in text
