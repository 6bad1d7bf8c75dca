"""checkpoint/nxd_files.py: NxD Training's tag directories read without torch-xla: torch-xla's
own xser files (tests/fixtures/nxd_ckpt/make_xser.py), markers and progress, and damaged or
incomplete checkpoints ending in one error naming the file and the fix; NxD's converter output
(model/ rank files only, no markers) read as it is."""
import os
import shutil

import pytest
import torch

from checkpoint import nxd_files, nxd_params, nxd_write
from configs import llama_tiny, mixtral_tiny
from model import transformer

FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'nxd_ckpt', 'xser_tag')
TAG = 'tiny--step=3-consumed_samples=24.0.ckpt'
RANK0 = os.path.join('model', 'dp_rank_00_tp_rank_00_pp_rank_00.pt')
MISSING_RANK = 'missing rank file model/dp_rank_00_tp_rank_01'    # docs/failure-and-recovery.md quotes it


def _copy(tmp_path):
  shutil.copytree(FIXTURE, tmp_path / 'ckpts')
  return tmp_path / 'ckpts' / TAG


def test_torch_xla_xser_files_load_with_their_aliases_and_inline_tensors():
  tag = nxd_files.open_tag(FIXTURE)                       # the checkpoints directory: its newest finished tag
  assert (tag.name, tag.tp, tag.pp, tag.ep, tag.legacy) == (TAG, 2, 1, 1, False)
  for r in range(2):
    state = nxd_files.read_rank(tag, 0, r, 0)
    o = torch.arange(12.0).view(3, 4) + 100 * r
    assert torch.equal(state['model.layers.0.self_attn.o_proj.weight'], o) and torch.equal(state['lm_head.weight'], o)
    assert torch.equal(state['model.norm.weight'], torch.ones(4) + r) and torch.equal(state['step'], torch.tensor(3.0))
  assert nxd_files.progress(tag) == {'step': 3, 'consumed_samples': 24, 'lr_schedulers': None}
  assert nxd_files.is_nxd_checkpoint(FIXTURE) and not nxd_files.is_nxd_checkpoint(os.path.dirname(FIXTURE))


@pytest.mark.parametrize('damage, message', [
    (lambda t: os.remove(t / 'model' / 'dp_rank_00_tp_rank_01_pp_rank_00.pt'), MISSING_RANK),
    (lambda t: _truncate(t / (RANK0 + '.tensors') / 'tensor_0.pt'), 'tensor_0.pt: unreadable xser tensor'),
    (lambda t: os.remove(t / (RANK0 + '.tensors') / 'tensor_1.pt'), 'its xser tensor 1 is missing'),
    (lambda t: _truncate(t / RANK0), 'dp_rank_00_tp_rank_00_pp_rank_00.pt: not a readable NxD checkpoint file'),
])
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, damage, message):
  tag = _copy(tmp_path)
  damage(tag)
  with pytest.raises(nxd_files.NxDCheckpointError, match=message) as raised:
    t = nxd_files.open_tag(str(tag))
    for r in range(t.tp):
      nxd_files.read_rank(t, 0, r, 0)
  assert '\n' not in str(raised.value)


def test_the_newest_finished_tag_is_taken_and_unfinished_ones_named(tmp_path):
  tag = _copy(tmp_path)
  later = tag.parent / 'tiny--step=9-consumed_samples=72.0.ckpt'
  shutil.copytree(tag, later)
  os.remove(later / 'done')                               # a save that did not finish
  assert nxd_files.open_tag(str(tag.parent)).name == TAG
  os.remove(tag / 'done')
  with pytest.raises(nxd_files.NxDCheckpointError, match=r'no NxD checkpoint tag with a `done` marker.*2 unfinished'):
    nxd_files.open_tag(str(tag.parent))


def test_a_run_directory_whose_only_tag_lacks_done_is_refused_but_the_tag_named_itself_loads(tmp_path):
  tag = _copy(tmp_path)
  os.remove(tag / 'done')
  says = rf'ckpts: no NxD .* \(1 unfinished: {TAG}; to read one whose save did finish as it is, name its directory\)$'
  with pytest.raises(nxd_files.NxDCheckpointError, match=says):
    nxd_files.open_tag(str(tag.parent))
  assert not os.path.exists(tag / 'done') and nxd_files.open_tag(str(tag)).name == TAG      # as NxD reads a named tag


def _converter_output(out, tp, pp):
  """(config, params) of a tiny Llama written as NxD's checkpoint_converter.py --output_dir writes
  it: out/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt and nothing else (no tag, no markers)."""
  c = llama_tiny.get_config('test')                     # 2 layers, 4 query and 2 KV heads
  params = transformer.init(c.model, 5)
  os.makedirs(out / 'model')
  for (_, r, s), state in nxd_write.split(params, c.model, tp, pp).items():
    torch.save(state, out / 'model' / f'dp_rank_00_tp_rank_{r:02d}_pp_rank_{s:02d}.pt')
  return c, params


def test_nxd_converter_output_loads_as_it_is_and_exactly(tmp_path):
  c, params = _converter_output(tmp_path / 'pretrained_ckpt', 2, 2)
  assert nxd_files.is_nxd_checkpoint(str(tmp_path / 'pretrained_ckpt'))
  tag = nxd_files.open_tag(str(tmp_path / 'pretrained_ckpt'))
  assert (tag.tp, tag.pp, tag.ep) == (2, 2, 1)
  assert nxd_files.progress(tag) == {'step': 0, 'consumed_samples': None, 'lr_schedulers': None}
  merged = nxd_params.merge(tag, c.model)
  vocab = c.model.vocab_size
  assert merged.keys() == params.keys()
  assert all(torch.equal(merged[n][:vocab], params[n][:vocab]) for n in params)


@pytest.mark.parametrize('removed', ['dp_rank_00_tp_rank_01_pp_rank_00.pt', 'dp_rank_00_tp_rank_00_pp_rank_01.pt'])
@pytest.mark.parametrize('done', [False, True])
def test_converter_output_missing_a_rank_file_is_refused_by_name(tmp_path, removed, done):
  out = tmp_path / 'pretrained_ckpt'
  _converter_output(out, 2, 2)
  os.remove(out / 'model' / removed)
  if done:
    (out / 'done').write_text('1')
  with pytest.raises(nxd_files.NxDCheckpointError, match=rf'missing rank file model/{removed} \(the others say tp=2, '
                                                         r'pp=2\); copy the whole tag directory$'):
    nxd_files.open_tag(str(out))


LAST_RANK_GONE = {   # every file of the last tp rank / pp stage gone: the names alone say a smaller layout
    'tp_rank_01': r'/model holds tp ranks 0\.\.0 but its embedding has 128 of the model\'s 256 vocabulary rows: the '
                  r'files of tp rank 1 are missing \(model/dp_rank_00_tp_rank_01_pp_rank_00\.pt, '
                  r'model/dp_rank_00_tp_rank_01_pp_rank_01\.pt\); copy the whole checkpoint directory$',
    'pp_rank_01': r'/model holds layers 0\.\.0 of the model\'s 2 \(num_layers\) and no final norm \(model\.norm\.weight\): '
                  r'the files of pp stage 1 are missing \(model/dp_rank_00_tp_rank_00_pp_rank_01\.pt, '
                  r'model/dp_rank_00_tp_rank_01_pp_rank_01\.pt\); copy the whole checkpoint directory$',
}


@pytest.mark.parametrize('gone', sorted(LAST_RANK_GONE))
def test_converter_output_missing_its_last_tp_rank_or_pp_stage_is_refused_naming_the_files(tmp_path, gone):
  out = tmp_path / 'pretrained_ckpt'
  c, _ = _converter_output(out, 2, 2)
  for name in os.listdir(out / 'model'):
    if gone in name:
      os.remove(out / 'model' / name)
  tag = nxd_files.open_tag(str(out))
  assert (tag.tp, tag.pp) == ((1, 2) if gone.startswith('tp') else (2, 1))
  with pytest.raises(nxd_files.NxDCheckpointError, match=LAST_RANK_GONE[gone]):
    nxd_params.merge(tag, c.model)


def test_a_mixtral_checkpoint_missing_its_last_ep_rank_is_refused_naming_the_files(tmp_path):
  c = mixtral_tiny.get_config('test')                   # 4 experts
  params = transformer.init(c.model, 5)
  os.makedirs(tmp_path / 'model')
  for (e, r, s), state in nxd_write.split(params, c.model, 2, 1, 2).items():
    if e == 0:
      torch.save(state, tmp_path / 'model' / f'dp_rank_00_ep_rank_00_tp_rank_{r:02d}_pp_rank_{s:02d}.pt')
  with pytest.raises(nxd_files.NxDCheckpointError, match=r'holds ep ranks 0\.\.0 but 2 of the model\'s 4 experts '
                     r'\(num_experts\): the files of ep rank 1 are missing \(model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00'):
    nxd_params.merge(nxd_files.open_tag(str(tmp_path)), c.model)


class _Payload:
  def __reduce__(self):
    return (os.system, ('touch ' + _Payload.target,))


def test_user_content_is_read_without_running_what_it_names(tmp_path):
  tag = _copy(tmp_path)
  _Payload.target = str(tmp_path / 'ran')
  torch.save({'global_step': 7, 'callbacks': _Payload(), 'lr_schedulers': [{'last_epoch': 7}]}, tag / 'user_content.pt')
  progress = nxd_files.progress(nxd_files.open_tag(str(tag)))
  assert progress['step'] == 7 and progress['lr_schedulers'] == [{'last_epoch': 7}]
  assert not os.path.exists(tmp_path / 'ran')


def _truncate(path):
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.truncate(size // 2)


def test_nxd_s_first_layout_reads_the_model_key(tmp_path):
  """tp_rank_TT_pp_rank_PP/checkpoint.pt holding {'model': state dict, ...} (NxD's first layout)."""
  tag = tmp_path / 'step_4'
  for r in range(2):
    os.makedirs(tag / f'tp_rank_{r:02d}_pp_rank_00')
    torch.save({'model': {'w': torch.full((2,), float(r))}, 'optimizer': {}}, tag / f'tp_rank_{r:02d}_pp_rank_00' / 'checkpoint.pt')
  (tag / 'done').write_text('1')
  t = nxd_files.open_tag(str(tag))
  assert (t.tp, t.pp, t.legacy) == (2, 1, True)
  assert torch.equal(nxd_files.read_rank(t, 0, 1, 0)['w'], torch.ones(2))
