"""The training loop end to end: metrics, TensorBoard, epochs, the test split, invariance to
the micro batch split, errors, CLI, which ranks print."""
import json
import os
import sys

import pytest
import torch

import train
from configs import llama_tiny
from data.loader import Loader
from estimates import memory_check
from model import transformer
from model.layers import LOCAL_OPS
from optim import update
from parallel import grads, mesh as meshes, training
from tests import procs, world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**trainer):
  c = llama_tiny.get_config('test')
  c.exp_manager.create_tensorboard_logger = False
  c.trainer.update(trainer)
  return c


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_training_writes_metrics_and_the_loss_falls(tmp_path):
  c = tiny_config(max_steps=30, val_check_interval=15, limit_val_batches=1, num_sanity_val_steps=1,
                  limit_test_batches=1)
  c.exp_manager.create_tensorboard_logger = True
  last = train.run(c, str(tmp_path))[0]
  records = read_metrics(tmp_path)
  steps = [r for r in records if 'loss' in r]
  vals = [r for r in records if 'val_loss' in r]
  assert [r['step'] for r in steps] == list(range(1, 31))
  for key in ('loss', 'lr', 'grad_norm', 'tokens_per_sec', 'mfu', 'consumed_samples', 'param_norm'):
    assert all(key in r for r in steps), key
  assert steps[-1]['consumed_samples'] == 30 * 8
  assert steps[-1]['loss'] < steps[0]['loss'] - 1.0
  assert [r['step'] for r in vals] == [15, 30] and vals[1]['val_loss'] < vals[0]['val_loss']
  assert records[-1] == {'step': 30, 'test_loss': last['test_loss'], 'consumed_samples': 240}
  assert last['test_loss'] != vals[1]['val_loss']              # the test split's own samples
  # TensorBoard: <workdir>/tensorboard/<name>, the run name also as text
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel
  events = event_accumulator.EventAccumulator(str(tmp_path / 'tensorboard' / 'llama_tiny'))
  events.Reload()
  assert {'loss', 'val_loss', 'test_loss'} <= set(events.Tags()['scalars'])
  assert events.Tensors('run_name/text_summary')[0].tensor_proto.string_val == [b'llama_tiny']
  assert json.load(open(tmp_path / 'config.json'))['model']['hidden_size'] == 32


def write_records(path, n, first=0):
  """n pre-tokenized SFT records (a prompt of 4 tokens, then 6 or more trained on)."""
  with open(path, 'w') as f:
    for i in range(first, first + n):
      f.write(json.dumps({'input_ids': [3 + (i + t) % 40 for t in range(10 + i % 5)],
                          'loss_mask': [0] * 4 + [1] * (6 + i % 5)}) + '\n')
  return str(path)


def test_max_epochs_stops_validates_every_epoch_and_tests_the_test_records(tmp_path, caplog):
  """20 rows per epoch, global batch 8: two epochs end on step ceil(40 / 8) = 5, long before
  max_steps; the epochs complete on steps 3 (24 samples) and 5 (40)."""
  c = tiny_config(max_steps=100, max_epochs=2, val_check_interval=0, check_val_every_n_epoch=1,
                  limit_val_batches=1, limit_test_batches=1)
  c.model_alignment_strategy.sft.packing = False            # one record per row: 20 rows
  c.data.train_dir = write_records(tmp_path / 'train.jsonl', 20)
  c.data.val_dir = write_records(tmp_path / 'val.jsonl', 8, first=20)
  c.data.test_dir = write_records(tmp_path / 'test.jsonl', 8, first=40)
  with caplog.at_level('INFO'):
    last, _ = train.run(c, str(tmp_path / 'run'))
  records = read_metrics(tmp_path / 'run')
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3, 4, 5]
  assert [(r['step'], r['consumed_samples']) for r in records if 'val_loss' in r] == [(3, 24), (5, 40)]
  assert records[-1] == {'step': 5, 'test_loss': last['test_loss'], 'consumed_samples': 40}
  assert f'step 5 | test_loss {last["test_loss"]:.4f}' in caplog.text and 'step 5/5 |' in caplog.text
  c.trainer.max_steps = 4                                    # whichever comes first
  assert train.last_step(c.trainer, Loader(c)) == 4


def run_losses(config, workdir):
  seen = []
  real_step = training.train_step

  def spy(*args, **kwargs):
    out = real_step(*args, **kwargs)
    seen.append(out['loss'].item())
    return out

  training.train_step = spy
  try:
    _, params = train.run(config, workdir)
  finally:
    training.train_step = real_step
  return seen, params


@pytest.mark.parametrize('dropout', [0.0, 0.1])
def test_micro_batch_split_does_not_change_the_update(tmp_path, dropout):
  """Gradient accumulation is exact: 1 x 8, 2 x 4 and 4 x 2 give the same training run."""
  runs = []
  for mbs in (8, 2, 1):
    c = tiny_config(max_steps=6, val_check_interval=0)
    c.data.micro_batch_size = mbs
    c.model.hidden_dropout = c.model.attention_dropout = dropout
    runs.append(run_losses(c, str(tmp_path / f'mbs{mbs}')))
  (ref_losses, ref_params), others = runs[0], runs[1:]
  for losses, params in others:
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name in ref_params:
      torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-5)


def test_clipping_matches_torch_clip_grad_norm():
  grad_list = [torch.randn(5, 3) * 10 for _ in range(3)]
  copies = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in grad_list]
  for c, g in zip(copies, grad_list):
    c.grad = g.clone()
  ref_norm = torch.nn.utils.clip_grad_norm_(copies, 1.0)
  gradients = {f'p{i}': g.clone() for i, g in enumerate(grad_list)}
  norm, coefficient = grads.clip(gradients, meshes.Mesh(), dict.fromkeys(gradients, 'column'), 1.0)
  assert coefficient is not None and coefficient.item() < 1.0
  torch.testing.assert_close(norm, ref_norm)
  for c, g in zip(copies, gradients.values()):
    torch.testing.assert_close(g, c.grad)


@pytest.mark.parametrize('policy', ['error', 'skip'])
def test_nonfinite_loss_stops_naming_the_step_or_skips(policy):
  c = tiny_config(nonfinite_policy=policy)
  mesh = meshes.Mesh()
  params = transformer.init(c.model, 0)
  with torch.no_grad():
    params['layers.0.mlp.up_proj.weight'][0, 0] = float('nan')
  before = {k: v.detach().clone() for k, v in params.items()}
  updater = update.Updater(params, c, mesh)
  batches = Loader(c).global_batch(0)
  if policy == 'error':
    with pytest.raises(FloatingPointError, match='step 8 '):   # the 8th step: logged as step 8
      training.train_step(params, updater, batches, c, 7, mesh, LOCAL_OPS)
  else:
    out = training.train_step(params, updater, batches, c, 7, mesh, LOCAL_OPS)
    assert out['skipped']
    for k in params:
      torch.testing.assert_close(params[k].detach(), before[k], equal_nan=True)


def test_skipped_steps_warn_log_null_and_stop_after_max_consecutive_skips(tmp_path, monkeypatch, caplog):
  def poisoned(config, mesh):
    params = init(config, mesh)
    with torch.no_grad():
      params['layers.0.mlp.up_proj.weight'][0, 0] = float('nan')
    return params
  init = training.init_params
  monkeypatch.setattr(training, 'init_params', poisoned)
  c = tiny_config(nonfinite_policy='skip', max_consecutive_skips=3, val_check_interval=0)
  with caplog.at_level('WARNING'), pytest.raises(FloatingPointError, match='3 steps in a row .* step 3'):
    train.run(c, str(tmp_path))
  assert 'step 2: non-finite loss or gradient; update skipped (2 in a row' in caplog.text

  def no_nan(text):
    raise AssertionError(f'metrics.jsonl holds {text}, which is not JSON')
  lines = open(tmp_path / 'metrics.jsonl').read().splitlines()
  records = [json.loads(line, parse_constant=no_nan) for line in lines]
  assert [r['step'] for r in records] == [1, 2] and all(r['loss'] is None and r['skipped'] for r in records)


def cli(*args):
  return procs.run([sys.executable, 'train.py', *args], timeout=240)


def test_cli_overrides_and_parse_time_errors(tmp_path):
  """Also: the run directory from exp_manager.exp_dir/<exp_manager.name>, with no --workdir."""
  ok = cli('--config=configs/llama_tiny.py:test', f'--config.exp_manager.exp_dir={tmp_path}',
           '--config.exp_manager.name=cli', '--config.trainer.max_steps=3', '--config.model.optim.sched.warmup_steps=2',
           '--config.exp_manager.create_tensorboard_logger=False', '--config.model.optim.lr=0.01')
  assert ok.returncode == 0, ok.stderr
  assert [r['step'] for r in read_metrics(tmp_path / 'cli') if 'loss' in r] == [1, 2, 3]
  assert read_metrics(tmp_path / 'cli')[0]['lr'] > 0
  nowhere = cli('--config=configs/llama_tiny.py:test')
  assert nowhere.returncode == 2 and 'Traceback' not in nowhere.stderr
  assert all(key in nowhere.stderr for key in ('--workdir', 'exp_manager.explicit_log_dir', 'exp_manager.exp_dir'))
  typo = cli('--config=configs/llama_tiny.py:test', f'--workdir={tmp_path}', '--config.trainer.max_stepz=3')
  assert typo.returncode != 0 and 'max_stepz' in typo.stderr
  bad = cli('--config=configs/llama_tiny.py:test', f'--workdir={tmp_path}', '--config.model.activation=relu',
            '--config.data.global_batch_size=7')
  assert bad.returncode != 0
  assert 'model.activation' in bad.stderr and 'data.global_batch_size=7' in bad.stderr
  assert 'Traceback' not in bad.stderr and bad.returncode == 2


def test_a_dry_run_that_does_not_fit_its_named_cluster_exits_2_naming_both_figures():
  layout = ['--config.distributed_strategy.tensor_model_parallel_size=4', '--config.distributed_strategy.sequence_parallel=True']
  out = procs.run([sys.executable, 'train.py', '--config=configs/llama3_70b.py', '--dry_run', *layout,
                   '--config.trainer.plan_cluster=trn1.32xlarge'], timeout=240, env=dict(os.environ, WORLD_SIZE='4'))
  assert out.returncode == 2 and 'Traceback' not in out.stderr, out.stderr[-3000:]
  assert 'error: does not fit a trn1.32xlarge device: this run needs an estimated' in out.stderr
  assert 'but a rank has 16.0 GiB (a trn1.32xlarge device)' in out.stderr
  assert 'memory/rank (estimate)' in out.stdout            # the summary is printed first


@pytest.mark.parametrize('args,message', [
    (['--config=configs/llama_tiny.py:test', '--config.model.hiden_size=3'],
     'error: --config.model.hiden_size: no such key; did you mean model.hidden_size?'),
    (['--config=configs/llama_tiny.py:test', '--config.hidden_size=3'],
     'error: --config.hidden_size: no such key; did you mean model.hidden_size?'),
    (['--config=configs/nope.py'], "error: --config=configs/nope.py: no such config file 'configs/nope.py'"),
    (['--config=configs/llama_tiny.py:bogus'], "unknown preset 'bogus'"),
    # a model no machine of ours holds (1.1 TB of training state): refused before allocating
    (['--config=configs/llama3_70b.py'], 'error: this run needs an estimated'),
])
def test_command_line_mistakes_are_one_line(tmp_path, args, message):
  out = cli(*args, f'--workdir={tmp_path}')
  assert out.returncode == 2, out.stderr[-2000:]
  assert message in out.stderr and 'Traceback' not in out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith('error: ')


def _train_as_two_hosts(workdir, rank_0_only):
  """Rank 1 plays the local rank 0 of a second host. -> what this rank printed."""
  import io, logging  # pylint: disable=import-outside-toplevel,multiple-imports
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  os.environ['LOCAL_RANK'] = '0'
  stream = io.StringIO()
  logging.getLogger().addHandler(logging.StreamHandler(stream))
  absl_logging.set_verbosity(absl_logging.INFO)
  c = tiny_config(max_steps=2, val_check_interval=0)
  c.model.optim.sched.warmup_steps = 1
  c.exp_manager.log_local_rank_0_only = rank_0_only
  train.run(c, workdir)
  return stream.getvalue()


def test_log_local_rank_0_only_false_prints_each_hosts_local_rank_0_with_its_rank(tmp_path):
  first, second = world.run(_train_as_two_hosts, 2, str(tmp_path), False)
  assert 'step 2/2 | loss' in first and '[rank' not in first
  assert '[rank 1] step 2/2 | loss' in second and '[rank 1] \nflatron | llama_tiny' in second


def test_an_oversized_model_is_refused_naming_both_figures_and_a_way_out(tmp_path):
  """The design card's own command, on a machine that cannot hold Llama-2 7B's training state."""
  if memory_check.available_bytes(torch.device('cpu'))[0] > 200 * 2**30:
    pytest.skip('this machine could hold llama7b')
  out = cli('--config=configs/llama7b.py', f'--workdir={tmp_path}')
  line = out.stderr.strip().splitlines()[-1]
  assert 'per rank but a rank has' in line and 'GiB' in line
  assert '--config=configs/llama7b.py:smoke' in line and 'memory_check=False' in line
  assert 'flatron | llama7b' in out.stderr       # the summary came first
  assert not os.path.exists(tmp_path / 'config.json')


def test_torchrun_tp2_sp_dp2_logs_the_single_process_losses(tmp_path):
  common = ['--config=configs/llama_tiny.py:test', '--config.trainer.max_steps=4',
            '--config.exp_manager.create_tensorboard_logger=False', '--config.trainer.val_check_interval=0']
  single = cli(*common, f'--workdir={tmp_path / "single"}')
  assert single.returncode == 0, single.stderr
  env = dict(os.environ, OMP_NUM_THREADS='1')
  multi = procs.run(
      [os.path.join(os.path.dirname(sys.executable), 'torchrun'), '--nproc_per_node=4',
       '--standalone', 'train.py', *common, f'--workdir={tmp_path / "multi"}',
       '--config.distributed_strategy.tensor_model_parallel_size=2',
       '--config.distributed_strategy.sequence_parallel=True'], timeout=300, env=env)
  assert multi.returncode == 0, multi.stderr[-3000:]
  assert 'dp=2 x pp=1 x tp=2 +sp' in multi.stderr
  losses = lambda d: [r['loss'] for r in read_metrics(d) if 'loss' in r]
  assert losses(tmp_path / 'multi') == pytest.approx(losses(tmp_path / 'single'), rel=1e-5)


def test_torchrun_pp2_logs_the_single_process_losses(tmp_path):
  common = ['--config=configs/llama_tiny.py:test', '--config.trainer.max_steps=3',
            '--config.model.optim.sched.warmup_steps=2',
            '--config.exp_manager.create_tensorboard_logger=False', '--config.trainer.val_check_interval=3',
            '--config.trainer.limit_val_batches=1']
  single = cli(*common, f'--workdir={tmp_path / "single"}')
  assert single.returncode == 0, single.stderr
  multi = procs.run(
      [os.path.join(os.path.dirname(sys.executable), 'torchrun'), '--nproc_per_node=2', '--standalone',
       'train.py', *common, f'--workdir={tmp_path / "multi"}',
       '--config.distributed_strategy.pipeline_model_parallel_size=2'],
      timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
  assert multi.returncode == 0, multi.stderr[-3000:]
  assert 'dp=1 x pp=2 x tp=1' in multi.stderr
  for key in ('loss', 'val_loss'):
    values = lambda d: [r[key] for r in read_metrics(d) if key in r]
    assert values(tmp_path / 'multi') == pytest.approx(values(tmp_path / 'single'), rel=1e-5)


def test_a_configured_tokenizer_is_checked_against_the_vocabulary_at_start_up(tmp_path):
  from data import errors, tokenizer  # pylint: disable=import-outside-toplevel
  (tmp_path / 'text.txt').write_text('\n'.join(f'line {i} of some text, with words' for i in range(300)))
  model = tokenizer.train_sentencepiece([str(tmp_path / 'text.txt')], str(tmp_path / 'tok'), 300)
  c = tiny_config()
  c.data.tokenizer.type, c.data.tokenizer.model = 'sentencepiece', model   # 300 tokens, vocab 256
  with pytest.raises(errors.DataError, match='--config.model.vocab_size=300'):
    train.run(c, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / 'metrics.jsonl')


def test_sft_of_an_hf_model_starts_from_its_exact_loss(tmp_path):
  """model_source=hf builds the model from config.json, init_from loads its weights, and the
  first step's loss on SFT records is transformers' own masked loss on the same batch."""
  transformers = pytest.importorskip('transformers')
  torch.manual_seed(0)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      vocab_size=64, max_position_embeddings=64, tie_word_embeddings=True)).float().eval()
  hf_model.save_pretrained(tmp_path / 'hf')
  records = [{'input_ids': list(range(3 + i, 13 + 2 * i)), 'loss_mask': [0] * 4 + [1] * (6 + i)} for i in range(8)]
  with open(tmp_path / 'sft.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  c = tiny_config(max_steps=4, val_check_interval=0)
  c.model_source, c.model.model_config = 'hf', str(tmp_path / 'hf' / 'config.json')
  c.exp_manager.init_from = str(tmp_path / 'hf')
  c.data.train_dir = c.data.val_dir = str(tmp_path / 'sft.jsonl')
  train.run(c, str(tmp_path / 'run'))
  first = read_metrics(tmp_path / 'run')[0]
  assert (c.model.hidden_size, c.model.vocab_size, c.model.share_embeddings_and_output_weights) == (32, 64, True)

  total, count = 0.0, 0
  for batch in Loader(c, 'train').global_batch(0):
    labels = batch['labels'].masked_fill(batch['loss_mask'] == 0, -100)
    with torch.no_grad():
      logits = hf_model(batch['tokens'], position_ids=batch['position_ids'],
                        attention_mask=_block_causal(batch['segment_ids'])).logits
    total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='sum').item()
    count += int(batch['loss_mask'].sum())
  assert first['step'] == 1 and first['loss'] == pytest.approx(total / count, rel=1e-5)


def _block_causal(segment_ids_bs):
  """A 4-D additive mask: causal and within each packed example (what transformers takes)."""
  s = segment_ids_bs.shape[1]
  allowed = (segment_ids_bs[:, :, None] == segment_ids_bs[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
  return torch.zeros(allowed.shape).masked_fill(~allowed, float('-inf'))[:, None]
