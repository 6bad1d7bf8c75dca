"""Training objectives: what the last pipeline stage computes from the logits.

An objective is two plain functions of a micro batch:
  count(batch)                       the normaliser it adds to the global batch's (tokens, or
                                     pairs), known before the forward pass so every micro
                                     batch's loss can be divided by the global total at once
  loss(logits, batch, cfg, ops)  ->  (loss sum, {metric name: sum})
                                     `logits` may be a chunked_ce.HeadInput (the head's input and
                                     weight, model.fusions.chunked_cross_entropy): per-token losses
                                     come from chunked_ce.token_losses, which takes either
Sums, not means: the loop divides by the global count, so every layout and micro-batch split
computes the same number. `for_config(config)` picks one by `model.objective`, with its
settings (model_alignment_strategy.dpo / .orpo) bound.

Preference objectives read one (chosen, rejected) pair per row: `chosen_mask` and
`rejected_mask` mark the labels of each response (data/preference.py). Sequence log-probs
are sums over those tokens (DPO) or their means (IPO, ORPO), as trl computes them:
  DPO   -log sigmoid(beta h) (1 - eps) - log sigmoid(-beta h) eps,  h = (c - r) - (c_ref - r_ref)
        (Rafailov et al. 2023; eps: label smoothing, the conservative DPO of cDPO)
  IPO   (h - 1 / (2 beta))^2 on mean log-probs (Azar et al. 2023)
  ORPO  -mean_t log p(chosen) - beta log sigmoid(log odds(c) - log odds(r)),
        odds(p) = p / (1 - p) on mean log-probs (Hong et al. 2024); the NLL is each pair's
        mean over its chosen tokens averaged over pairs (orpo.nll_reduction=pair: the paper and
        NxD Training's base_orpo.py), or the mean over the global batch's chosen tokens
        (nll_reduction=token: trl's ORPOTrainer).
Reference log-probs (DPO, IPO) come in the batch as `ref_logps` [b, 2] (the loop computes
them: train.py). Metrics are trl's: rewards/{chosen,rejected,accuracies,margins}, logps/*.
"""
import functools
import typing

import torch
import torch.nn.functional as F

from config_checks import one_of, positive
from model import chunked_ce, lora


class Objective(typing.NamedTuple):
  count: typing.Callable
  loss: typing.Callable
  metrics: tuple = ()              # names of the metric sums loss() returns
  reference: typing.Any = None     # the Objective giving reference log-probs, when one is needed
  # A second normaliser, summed over the global batch like `count`; loss() then finds both
  # global totals in batch['global_count'] and batch['global_extra'] (ORPO's token-mean NLL).
  extra_count: typing.Callable = None
  row_count: typing.Callable = None  # [b]: each row's share of `count` (None: 1 a row); weights MoE's per-row aux losses
  adds_aux: bool = True              # MoE auxiliary losses join loss() (not for a reference's log-probs)
  # loss() sums whole rows (ops.row_sum over the cp group): every cp rank returns the same
  # loss and metrics, which the pass then counts on one of them only
  whole_rows: bool = False


def _loss_mask_count(batch):
  return batch['loss_mask'].sum()


def _pair_count(batch):
  return torch.tensor(float(batch['chosen_mask'].shape[0]))


def _chosen_token_count(batch):
  return batch['chosen_mask'].sum().float()


def _next_token_loss(logits_bsv, batch, cfg, ops):
  """Cross-entropy of each next token where loss_mask is 1 (pretraining; SFT masks prompts)."""
  per_token = chunked_ce.token_losses(logits_bsv, batch['labels'], cfg, ops)
  return (per_token * batch['loss_mask']).sum(), {}


def pair_logps(logits_bsv, batch, cfg, ops, mean=False):
  """[b, 2]: log p(chosen response), log p(rejected response) of each row's pair (sums over
  their tokens, or means with `mean`)."""
  totals, counts = _pair_sums(-chunked_ce.token_losses(logits_bsv, batch['labels'], cfg, ops), batch, ops)
  return totals / counts.clamp(min=1) if mean else totals


def _pair_sums(token_logp, batch, ops):
  """([b, 2] sums of the chosen and rejected tokens' log-probs, [b, 2] their token counts),
  over whole rows: at cp > 1 each rank holds a slice of every row, so one all-reduce over cp
  (ops.row_sum) adds the slices' sums before anything nonlinear reads them."""
  masks = [batch[key].to(token_logp.dtype) for key in ('chosen_mask', 'rejected_mask')]
  sums = ops.row_sum(torch.stack([(token_logp * m).sum(-1) for m in masks] + [m.sum(-1) for m in masks], dim=-1))
  return sums[:, :2], sums[:, 2:]


def _metrics(rewards, logps):
  chosen, rejected = rewards.detach().unbind(-1)
  return {'rewards/chosen': chosen.sum(), 'rewards/rejected': rejected.sum(),
          'rewards/accuracies': (chosen > rejected).float().sum(), 'rewards/margins': (chosen - rejected).sum(),
          'logps/chosen': logps[:, 0].detach().sum(), 'logps/rejected': logps[:, 1].detach().sum()}


def _dpo_loss(logits_bsv, batch, cfg, ops, *, settings):
  ipo = settings.loss_type == 'ipo'
  beta = settings.kl_beta
  logps = pair_logps(logits_bsv, batch, cfg, ops, mean=ipo)
  ref = batch['ref_logps'].to(logps.dtype)
  h = (logps[:, 0] - logps[:, 1]) - (ref[:, 0] - ref[:, 1])
  if ipo:
    losses = (h - 1 / (2 * beta)) ** 2
  else:
    eps = settings.label_smoothing
    losses = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
  return losses.sum(), _metrics(beta * (logps - ref), logps)


def log1mexp(x):
  """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
  return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _orpo_loss(logits_bsv, batch, cfg, ops, *, settings):
  token_logp = -chunked_ce.token_losses(logits_bsv, batch['labels'], cfg, ops)   # once: the head may be chunked
  totals, counts = _pair_sums(token_logp, batch, ops)
  logps = totals / counts.clamp(min=1)
  chosen, rejected = logps.unbind(-1)
  log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
  ratio = F.logsigmoid(log_odds)
  if settings.nll_reduction == 'token':   # trl: over the global batch's chosen tokens, not per pair
    nll = -totals[:, 0] * (batch['global_count'] / batch['global_extra'].clamp(min=1))
  else:                                   # NxD Training and the paper: each pair's mean, averaged
    nll = -chosen
  losses = nll - settings.beta * ratio
  metrics = _metrics(settings.beta * logps, logps)
  metrics.update({'nll_loss': nll.detach().sum(), 'log_odds_ratio': ratio.detach().sum(),
                  'log_odds_chosen': log_odds.detach().sum()})
  return losses.sum(), metrics


NEXT_TOKEN = Objective(_loss_mask_count, _next_token_loss, row_count=lambda batch: batch['loss_mask'].sum(-1))
PREFERENCE_METRICS = ('rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'rewards/margins',
                      'logps/chosen', 'logps/rejected')
NAMES = ('next_token', 'dpo', 'orpo')
LOSS_TYPES = ('sigmoid', 'ipo')
REFERENCE_MODELS = ('start', 'base')
NLL_REDUCTIONS = ('pair', 'token')


def for_config(config) -> Objective:
  """The objective `config.model.objective` names, with its alignment settings bound."""
  name = config.model.objective
  if name == 'next_token':
    return NEXT_TOKEN
  if name == 'dpo':
    settings = config.model_alignment_strategy.dpo
    mean = settings.loss_type == 'ipo'
    reference = Objective(_pair_count, lambda logits, batch, cfg, ops: (pair_logps(logits, batch, cfg, ops, mean), {}),
                          adds_aux=False)
    return Objective(_pair_count, functools.partial(_dpo_loss, settings=settings), PREFERENCE_METRICS, reference,
                     whole_rows=True)
  if name == 'orpo':
    settings = config.model_alignment_strategy.orpo
    return Objective(_pair_count, functools.partial(_orpo_loss, settings=settings),
                     PREFERENCE_METRICS + ('nll_loss', 'log_odds_ratio', 'log_odds_chosen'),
                     extra_count=_chosen_token_count if settings.nll_reduction == 'token' else None, whole_rows=True)
  raise ValueError(f'model.objective={name!r} is unknown; valid: {", ".join(NAMES)}')


def check(config) -> list:
  """Problems with model.objective and the preference settings (model_alignment_strategy) it reads."""
  problems = []
  objective, strategy = config.model.objective, config.model_alignment_strategy
  one_of(problems, 'model.objective', objective, NAMES)
  if objective == 'dpo':
    one_of(problems, 'model_alignment_strategy.dpo.loss_type', strategy.dpo.loss_type, LOSS_TYPES)
    positive(problems, 'model_alignment_strategy.dpo.kl_beta', strategy.dpo.kl_beta)
    if not 0.0 <= strategy.dpo.label_smoothing < 0.5:
      problems.append(f'model_alignment_strategy.dpo.label_smoothing={strategy.dpo.label_smoothing} '
                      'must be in [0, 0.5)')
    one_of(problems, 'model_alignment_strategy.dpo.reference_model', strategy.dpo.reference_model,
           REFERENCE_MODELS)
    if strategy.dpo.reference_model == 'base' and not lora.settings(config.model):
      problems.append('model_alignment_strategy.dpo.reference_model=base needs LoRA (the base with the adapters '
                      'off); without LoRA the reference is the starting model: set it to start')
  if objective == 'orpo':
    positive(problems, 'model_alignment_strategy.orpo.beta', strategy.orpo.beta)
    one_of(problems, 'model_alignment_strategy.orpo.nll_reduction', strategy.orpo.nll_reduction, NLL_REDUCTIONS)
  if objective in ('dpo', 'orpo') and not config.data.train_dir:
    problems.append(f'model.objective={objective} trains on preference pairs: set data.train_dir '
                    '(and data.val_dir) to (prompt, chosen, rejected) records')
  return problems


def reference_copy(config) -> str:
  """What the reference needs besides the policy's tensors: 'model' (a copy of the starting
  model), 'adapters' (a copy of the starting adapters) or 'none' (the base alone)."""
  peft = lora.settings(config.model)
  if peft is None:
    return 'model'
  start = config.model_alignment_strategy.dpo.reference_model == 'start'
  return 'adapters' if start and peft.load_lora_from_ckpt else 'none'
