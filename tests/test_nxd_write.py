"""checkpoint/nxd_write.py: rank files as NxD's modules hold them (GQAQKVColumnParallelLinear's
head placement on trn1 and trn2, ExpertMLPs against NxD Core's own shards) and NxD Training's
tag (name, markers, user_content). Round trips through nxd_params: tests/test_nxd_params.py."""
import os

import torch

from checkpoint import nxd_files, nxd_write
from model import hf, param_table
from tests.test_hf import BASE_MODEL, family_model
from tests.test_nxd_params import NXD_CORE


def test_where_nxd_puts_each_head():
  """tp 4, 8 query and 2 KV heads, kv_replicator 2 (head_dim 8): trn1's kv-shared groups are
  ranks {g, g + 2}, rank r holding KV head r % 2 and query block (r % 2) x 2 + r // 2; trn2's are
  adjacent ranks, rank r holding KV head r // 2 and query heads 2r, 2r + 1; rows [Q | K | V]."""
  cfg = family_model('llama', dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)).config
  m = hf.config_from_hf(cfg.to_dict(), BASE_MODEL)
  d, h = 8, 64
  params = {n: torch.zeros(s.shape) for n, s in param_table.param_specs(m, adapters=False).items()}
  params['layers.0.self_attn.q_proj.weight'] = torch.arange(8).repeat_interleave(d)[:, None].float().expand(64, h)
  params['layers.0.self_attn.k_proj.weight'] = 100 + torch.arange(2).repeat_interleave(d)[:, None].float().expand(16, h)
  params['layers.0.self_attn.v_proj.weight'] = 200 + torch.arange(2).repeat_interleave(d)[:, None].float().expand(16, h)
  for hw, q_heads, kv_head in (('trn1', [[0, 1], [4, 5], [2, 3], [6, 7]], [0, 1, 0, 1]),
                               ('trn2', [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 0, 1, 1])):
    shards = nxd_write.split(params, m, 4, kv_replicator=2, hw=hw)
    for r in range(4):
      rows = shards[(0, r, 0)]['model.layers.0.self_attn.qkv_proj.weight_qkv'][:, 0].view(-1, d)[:, 0].tolist()
      assert rows == q_heads[r] + [100 + kv_head[r], 200 + kv_head[r]], (hw, r, rows)


def test_nxd_write_holds_the_experts_as_nxd_s_expert_mlps_does():
  """ExpertMLPs(4 experts, h 32, f 16) at tp 2, initialized by NxD from known weights."""
  full = torch.load(os.path.join(NXD_CORE, 'expert_mlps_e4_tp2_ep1', 'full.pt'), weights_only=True)
  cfg = hf.config_from_hf(dict(architectures=['MixtralForCausalLM'], model_type='mixtral', hidden_size=32,
                               intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                               vocab_size=64, num_local_experts=4, num_experts_per_tok=2), BASE_MODEL)
  params = {n: torch.zeros(s.shape) for n, s in param_table.param_specs(cfg, adapters=False).items()}
  params.update({'layers.0.mlp.experts.' + n: full[n + '.weight'] for n in ('gate_proj', 'up_proj', 'down_proj')})
  shards = nxd_write.split(params, cfg, 2)
  for r in range(2):
    theirs = torch.load(os.path.join(NXD_CORE, 'expert_mlps_e4_tp2_ep1', f'rank_{r}.pt'), weights_only=True)
    mine = shards[(0, r, 0)]
    for key in ('gate_up_proj', 'down_proj'):
      assert torch.equal(mine[f'model.layers.0.mlp.expert_mlps.mlp_op.{key}.weight'], theirs[f'mlp_op.{key}.weight'])


def test_the_tag_is_named_and_marked_as_nxd_training_writes_it(tmp_path):
  cfg = family_model('llama', dict(num_hidden_layers=1)).config
  m = hf.config_from_hf(cfg.to_dict(), BASE_MODEL)
  params = {n: torch.zeros(s.shape) for n, s in param_table.param_specs(m, adapters=False).items()}
  tag = nxd_write.write_tag(str(tmp_path), nxd_write.split(params, m, 2, 1, 1), 'hf_llama3_8B', 5, 160)
  assert os.path.basename(tag) == 'hf_llama3_8B--step=5-consumed_samples=160.0.ckpt'
  assert sorted(os.listdir(tag)) == ['checkpoint', 'done', 'model', 'user_content.pt']
  assert sorted(os.listdir(os.path.join(tag, 'model'))) == ['dp_rank_00_tp_rank_00_pp_rank_00.pt',
                                                            'dp_rank_00_tp_rank_01_pp_rank_00.pt']
  assert nxd_files.progress(nxd_files.open_tag(tag)) == {'step': 5, 'consumed_samples': 160, 'lr_schedulers': None}
