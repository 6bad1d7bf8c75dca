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
