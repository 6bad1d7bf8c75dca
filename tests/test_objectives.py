"""model/objectives.py: next-token, DPO / IPO and ORPO losses against hand-computed values and
trl's own functions on the same log-probabilities."""
import math
import types

import pytest
import torch
import torch.nn.functional as F

from configs import base
from model import objectives
from model.layers import LOCAL_OPS
from tests import parity

VOCAB = 11
# Each loss adds a log-softmax over VOCAB logits, a response's <= 3 tokens and the batch's 3 pairs:
# the test's float32 formulas add them in another order than the objectives (gather vs chunked
# cross-entropy, trl's reductions), and another CPU adds them in another order again.
TERMS = VOCAB + 3 + 3
REL = parity.roundoff(TERMS)        # ~8e-6 of a result whose terms share its sign


def _pair_batch(seed=0, b=3, s=9):
  """Random logits and a batch of b pairs: tokens 1-3 chosen responses, 5-7 rejected."""
  g = torch.Generator().manual_seed(seed)
  logits = torch.randn(b, s, VOCAB, generator=g, dtype=torch.float32)
  labels = torch.randint(0, VOCAB, (b, s), generator=g)
  chosen, rejected = torch.zeros(b, s), torch.zeros(b, s)
  chosen[:, 1:4], rejected[:, 5:8] = 1, 1
  rejected[0, 7] = 0                                  # unequal lengths
  batch = {'labels': labels, 'chosen_mask': chosen, 'rejected_mask': rejected, 'loss_mask': chosen,
           'ref_logps': torch.randn(b, 2, generator=g, dtype=torch.float32) - 5}
  token_logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
  return logits, batch, token_logp


def _config(objective, **settings):
  c = base.get_config()
  c.model.objective, c.model.vocab_size = objective, VOCAB
  section = c.model_alignment_strategy.dpo if objective == 'dpo' else c.model_alignment_strategy.orpo
  section.update(settings)
  return c


def _loss(config, logits, batch):
  return objectives.for_config(config).loss(logits, batch, config.model, LOCAL_OPS)


def test_pair_logps_are_sums_or_means_over_each_response():
  logits, batch, token_logp = _pair_batch()
  sums = objectives.pair_logps(logits, batch, types.SimpleNamespace(vocab_size=VOCAB), LOCAL_OPS)
  torch.testing.assert_close(sums[:, 0], token_logp[:, 1:4].sum(-1))
  torch.testing.assert_close(sums[0, 1], token_logp[0, 5:7].sum())
  means = objectives.pair_logps(logits, batch, types.SimpleNamespace(vocab_size=VOCAB), LOCAL_OPS, mean=True)
  torch.testing.assert_close(means[0, 1], token_logp[0, 5:7].mean())


@pytest.mark.parametrize('beta, smoothing', [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_sigmoid_equals_the_formula_by_hand(beta, smoothing):
  logits, batch, token_logp = _pair_batch()
  loss, metrics = _loss(_config('dpo', kl_beta=beta, label_smoothing=smoothing), logits, batch)
  expected, accuracy = 0.0, 0.0
  for i in range(3):
    c = token_logp[i, 1:4].sum().item()
    r = token_logp[i, 5:8 if i else 7].sum().item()
    cr, rr = batch['ref_logps'][i].tolist()
    h = (c - r) - (cr - rr)
    expected += -math.log(1 / (1 + math.exp(-beta * h))) * (1 - smoothing) - \
        math.log(1 / (1 + math.exp(beta * h))) * smoothing
    accuracy += float(beta * (c - cr) > beta * (r - rr))
  assert loss.item() == pytest.approx(expected, rel=1e-5)
  assert metrics['rewards/accuracies'].item() == accuracy
  torch.testing.assert_close(metrics['rewards/margins'], metrics['rewards/chosen'] - metrics['rewards/rejected'])


def test_ipo_uses_mean_log_probs():
  logits, batch, token_logp = _pair_batch()
  beta = 0.3
  loss, _ = _loss(_config('dpo', kl_beta=beta, loss_type='ipo'), logits, batch)
  expected = 0.0
  for i in range(3):
    c, r = token_logp[i, 1:4].mean().item(), token_logp[i, 5:8 if i else 7].mean().item()
    cr, rr = batch['ref_logps'][i].tolist()        # the loop passes mean reference logps for IPO
    expected += ((c - r) - (cr - rr) - 1 / (2 * beta)) ** 2
  assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_orpo_equals_the_paper_and_trl():
  logits, batch, token_logp = _pair_batch()
  beta = 0.25
  loss, metrics = _loss(_config('orpo', beta=beta), logits, batch)
  means = torch.stack([token_logp[:, 1:4].mean(-1), torch.stack(
      [token_logp[0, 5:7].mean(), token_logp[1, 5:8].mean(), token_logp[2, 5:8].mean()])], -1)
  odds = means.exp() / (1 - means.exp())
  ratio = F.logsigmoid(torch.log(odds[:, 0] / odds[:, 1]))
  assert loss.item() == pytest.approx((-means[:, 0] - beta * ratio).sum().item(), rel=1e-5)
  assert metrics['nll_loss'].item() == pytest.approx(-means[:, 0].sum().item(), rel=REL)

  trl = pytest.importorskip('trl.experimental.orpo.orpo_trainer')
  fake = types.SimpleNamespace(beta=beta, accelerator=types.SimpleNamespace(device='cpu'))
  theirs, chosen_rewards, rejected_rewards, mean_ratio, _ = trl.ORPOTrainer.odds_ratio_loss(fake, means[:, 0], means[:, 1])
  # loss - nll cancels: its round-off is the loss's and the NLL's, not the difference's
  cancelled = parity.roundoff(TERMS, scale=loss.abs().item() + metrics['nll_loss'].abs().item())
  torch.testing.assert_close(-theirs.sum(), loss - metrics['nll_loss'], rtol=REL, atol=cancelled)
  # the log-odds cancel the chosen and rejected mean log-probs (and their log(1 - p))
  log_odds_scale = 2 * (metrics['logps/chosen'].abs() + metrics['logps/rejected'].abs()).item()
  assert 3 * mean_ratio.item() == pytest.approx(metrics['log_odds_ratio'].item(),
                                                rel=REL, abs=parity.roundoff(TERMS, scale=log_odds_scale))
  torch.testing.assert_close(chosen_rewards.sum(), metrics['rewards/chosen'].float(), rtol=REL, atol=0)


def _with_totals(objective, batch, pairs, tokens):
  return dict(batch, global_count=torch.tensor(float(pairs)), global_extra=torch.tensor(float(tokens)))


def test_orpo_token_reduction_equals_trl_and_splits_like_the_global_batch():
  """nll_reduction=token: trl's NLL, the mean cross-entropy over the batch's chosen tokens
  (labels -100 elsewhere), whatever the micro batch split; pair (the default) is NxD's."""
  logits, batch, _ = _pair_batch()
  batch['chosen_mask'] = batch['loss_mask'] = batch['chosen_mask'].clone()
  batch['chosen_mask'][0, 2:4] = 0                    # chosen responses of 1, 3 and 3 tokens
  beta = 0.25
  config = _config('orpo', beta=beta, nll_reduction='token')
  objective = objectives.for_config(config)
  tokens = objective.extra_count(batch)
  loss, metrics = _loss(config, logits, _with_totals(objective, batch, 3, tokens))
  labels = batch['labels'].masked_fill(batch['chosen_mask'] == 0, -100)
  trl_nll = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)   # trl's cross_entropy_loss
  assert metrics['nll_loss'].item() / 3 == pytest.approx(trl_nll.item(), rel=REL)
  pair_loss, pair_metrics = _loss(_config('orpo', beta=beta), logits, batch)
  # the odds-ratio terms are the same bits in both reductions; loss - nll cancels, so the two
  # differences round at the magnitude of the losses and NLLs (3 pairs and the subtraction)
  scale = sum(abs(t.item()) for t in (loss, metrics['nll_loss'], pair_loss, pair_metrics['nll_loss']))
  assert (loss - metrics['nll_loss']).item() == pytest.approx(
      (pair_loss - pair_metrics['nll_loss']).item(), rel=0, abs=parity.roundoff(3 + 1, scale=scale))
  assert metrics['nll_loss'].item() != pytest.approx(pair_metrics['nll_loss'].item(), rel=1e-3)  # they differ here
  pieces = [{k: v[rows] for k, v in batch.items()} for rows in (slice(0, 1), slice(1, 3))]
  split = sum(_loss(config, logits[rows], _with_totals(objective, piece, 3, tokens))[0]
              for rows, piece in zip((slice(0, 1), slice(1, 3)), pieces))
  assert split.item() == pytest.approx(loss.item(), rel=REL)


def test_next_token_and_counts():
  logits, batch, token_logp = _pair_batch()
  loss, _ = objectives.NEXT_TOKEN.loss(logits, batch, types.SimpleNamespace(vocab_size=VOCAB), LOCAL_OPS)
  torch.testing.assert_close(loss, -(token_logp * batch['loss_mask']).sum())
  assert objectives.NEXT_TOKEN.count(batch).item() == 9
  assert objectives.for_config(_config('dpo')).count(batch).item() == 3
  c = base.get_config()
  c.model.objective = 'ppo'
  with pytest.raises(ValueError, match='model.objective'):
    objectives.for_config(c)


@pytest.mark.parametrize('objective, setting, message', [
    ('dpo', {'loss_type': 'sigmod'}, 'dpo.loss_type'),
    ('dpo', {'kl_beta': 0.0}, 'dpo.kl_beta'),
    ('dpo', {'label_smoothing': 0.5}, 'dpo.label_smoothing'),
    ('orpo', {'beta': -1.0}, 'orpo.beta'),
])
def test_bad_preference_settings_name_their_key(objective, setting, message):
  from configs import validate  # pylint: disable=import-outside-toplevel
  c = _config(objective, **setting)
  c.data.train_dir = 'pairs.jsonl'
  assert any(message in p for p in validate.check(c))
  c = _config(objective)
  problems = validate.check(c)
  assert len(problems) == 1 and 'data.train_dir' in problems[0]
