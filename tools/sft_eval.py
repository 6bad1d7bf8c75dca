"""Score a fine-tune on held-out SFT records: greedy replies against the references, as NxD
Training's examples/sft_evaluation/ does (exact match, ROUGE-L, BLEU).

    python -m tools.sft_eval --model=runs/sft/checkpoints --data=.data/chitchat/val.jsonl
    python -m tools.sft_eval --model=.data/models/smollm2-135m-instruct --model=runs/sft/checkpoints \
        --data=.data/chitchat/val.jsonl --limit=32 --out=runs/sft/sft_eval.json    # before | after

Each --model (a flatron checkpoint step, a checkpoint directory - its newest committed step -
or an HF model directory, as tools/generate.py takes) is one column of the table, in the order
given: repeat --model to put the base model beside the fine-tune. For each of the first
--limit records of --data (file order):
  {"messages": [...]}            the prompt is the messages before the last assistant message,
                                 through the chat template with the generation prompt; the
                                 reference is that assistant message (later turns are dropped)
  {"input": str, "output": str}  the prompt is `input` as plain text (BOS first, as training
                                 tokenizes it); the reference is `output`
Replies are greedy (tools/generate.py's reply), cut at end-of-sequence. Metrics, over the records:
  exact match  the share of replies equal to their reference, both stripped (0-1)
  ROUGE-L F1   rouge_score's rougeL F-measure with the Porter stemmer, averaged (0-1)
  BLEU         sacrebleu's corpus BLEU with its default 13a tokenization (0-100)
rouge_score splits on non-alphanumerics (English-style text). --out writes JSON: the settings,
and per model its metrics and each record's {prompt, reference, reply, exact, rougeL}.
The tokenizer is the model's own (an HF directory's, or the run's data.tokenizer) unless
--tokenizer_dir names an HF directory; it applies to every --model.
"""
import json
import os
import sys
import typing

from absl import app, flags

import tools
import user_errors
from data import sft_records
from data.errors import DataError

FLAGS = flags.FLAGS
INSTALL = 'pip install rouge-score sacrebleu (both are in requirements.txt)'
LOG_EVERY = 16


class Example(typing.NamedTuple):
  where: str             # 'file line 7', for errors
  prompt: typing.Any     # the input string, or the messages before the reference
  reference: str

  @property
  def is_chat(self):
    return isinstance(self.prompt, list)


def log(msg):
  print(f'[sft_eval] {msg}', file=sys.stderr, flush=True)


# ---- records -> (prompt, reference)

def read_examples(path, limit=None) -> list:
  """The first `limit` (all when None) records of `path` as Examples; DataError names the
  file and line of a record that cannot be one."""
  if not path or not os.path.exists(path):
    raise DataError(f'{path}: no such file or directory; --data takes SFT records (.jsonl, .json, '
                    '.arrow, or a directory of them), e.g. .data/chitchat/val.jsonl from tools/sft_demo.py')
  if limit is not None and limit < 1:
    raise DataError(f'--limit={limit}: evaluate at least one record (leave it out for all)')
  records = sft_records.read_files(path, limit)
  if not records:
    raise DataError(f'{path}: no records; it needs at least one {{"messages": [...]}} or '
                    '{"input", "output"} record')
  return [example(r) for r in records]


def example(record) -> Example:
  """The prompt and reference of one Record (data/sft_records.py); DataError when it has none."""
  kind = sft_records.record_kind(record)   # checks types; a chat without an assistant turn fails here
  f = record.fields
  if kind == 'prompt':
    return Example(record.where, f['input'], f['output'])
  if kind == 'tokens':
    raise DataError(f'{record.where}: a pre-tokenized record has no text to score against; '
                    'evaluate on {"input", "output"} or {"messages"} records')
  messages = f['messages']
  last = max(i for i, m in enumerate(messages) if m['role'] == 'assistant')
  if last == 0:
    raise DataError(f'{record.where}: the only assistant message comes first, so nothing prompts it; '
                    'start the conversation with a system or user message')
  if not isinstance(messages[last].get('content'), str):
    raise DataError(f'{record.where}: the last assistant message has tool calls, no text content, so '
                    'there is no reference reply; end the record on an assistant message with content')
  return Example(record.where, messages[:last], messages[last]['content'])


# ---- scoring: lists of strings in, numbers out

class MissingLibrary(user_errors.UserError, ImportError):
  """A scoring library is not installed (not any ImportError: those keep their traceback)."""


def _library(name):
  import importlib  # pylint: disable=import-outside-toplevel
  try:
    return importlib.import_module(name)
  except ImportError:
    raise MissingLibrary(f'{name} is not installed; the scores need it: {INSTALL}') from None


def _check(replies, references):
  if len(replies) != len(references):
    raise ValueError(f'{len(replies)} replies for {len(references)} references; score them in pairs')
  if not replies:
    raise ValueError('nothing to score: no replies')


def exact_matches(replies, references) -> list:
  _check(replies, references)
  return [r.strip() == ref.strip() for r, ref in zip(replies, references)]


def rouge_l(replies, references) -> list:
  """ROUGE-L F1 of each reply against its reference (Porter-stemmed, as NxDT's evaluation)."""
  _check(replies, references)
  scorer = _library('rouge_score.rouge_scorer').RougeScorer(['rougeL'], use_stemmer=True)
  return [scorer.score(ref, r)['rougeL'].fmeasure for r, ref in zip(replies, references)]


def corpus_bleu(replies, references) -> float:
  """sacrebleu's corpus BLEU (0-100): n-gram counts pooled over all replies, one reference each."""
  _check(replies, references)
  return float(_library('sacrebleu').corpus_bleu(list(replies), [list(references)]).score)


def score(replies, references) -> dict:
  """{'count', 'exact_match', 'rougeL', 'bleu', 'exact': [bool], 'rougeL_each': [float]}."""
  exact, rouge = exact_matches(replies, references), rouge_l(replies, references)
  return {'count': len(replies), 'exact_match': sum(exact) / len(exact), 'rougeL': sum(rouge) / len(rouge),
          'bleu': corpus_bleu(replies, references), 'exact': exact, 'rougeL_each': rouge}


# ---- generation and the report

def replies(model_path, examples, tokenizer_dir=None, max_new_tokens=64) -> list:
  """Greedy replies of the model at `model_path` to each Example's prompt."""
  from checkpoint import state as states  # pylint: disable=import-outside-toplevel  (loads torch)
  from tools import generate  # pylint: disable=import-outside-toplevel
  model = generate.load_model(model_path)
  # As tools/generate.py: an HF directory names no tokenizer in a config, its own files are it.
  tokenizer_dir = tokenizer_dir or (states.resolve_step(model_path) if model[2] is None else None)
  out = []
  for i, ex in enumerate(examples, 1):
    kwargs = {'messages': ex.prompt} if ex.is_chat else {'prompt': ex.prompt}
    out.append(generate.reply(model, tokenizer_dir=tokenizer_dir, max_new_tokens=max_new_tokens, **kwargs))
    if i % LOG_EVERY == 0 or i == len(examples):
      log(f'{model_path}: {i}/{len(examples)} replies')
  return out


def evaluate(model_path, examples, tokenizer_dir=None, max_new_tokens=64) -> dict:
  """One model's metrics and per-record results (the JSON's entry for it)."""
  from checkpoint import state as states  # pylint: disable=import-outside-toplevel
  texts = replies(model_path, examples, tokenizer_dir, max_new_tokens)
  scores = score(texts, [ex.reference for ex in examples])
  per_record = [{'prompt': ex.prompt, 'reference': ex.reference, 'reply': text, 'exact': exact, 'rougeL': rouge}
                for ex, text, exact, rouge in zip(examples, texts, scores['exact'], scores['rougeL_each'])]
  return {'model': model_path, 'step': states.resolve_step(model_path),
          'metrics': {k: scores[k] for k in ('count', 'exact_match', 'rougeL', 'bleu')}, 'examples': per_record}


def table(results) -> str:
  """A markdown table: one row per metric, one column per model."""
  rows = [('exact match', 'exact_match', '{:.3f}'), ('ROUGE-L F1', 'rougeL', '{:.3f}'),
          ('BLEU (0-100)', 'bleu', '{:.2f}'), ('records', 'count', '{}')]
  lines = ['| metric | ' + ' | '.join(r['model'] for r in results) + ' |',
           '|---' * (len(results) + 1) + '|']
  for label, key, fmt in rows:
    lines.append(f'| {label} | ' + ' | '.join(fmt.format(r['metrics'][key]) for r in results) + ' |')
  return '\n'.join(lines)


def run(models, data, limit=None, max_new_tokens=64, tokenizer_dir=None, out=None) -> dict:
  """Evaluate each model on the first `limit` records of `data`; print the table, write `out`."""
  from checkpoint import state as states  # pylint: disable=import-outside-toplevel
  examples = read_examples(data, limit)
  # Fail before generating, not after: the libraries, and every model path.
  _library('rouge_score.rouge_scorer')
  _library('sacrebleu')
  for model in models:
    states.resolve_step(model)
  log(f'{len(examples)} records of {data}, {len(models)} model(s), up to {max_new_tokens} new tokens each')
  results = {'data': data, 'limit': limit, 'max_new_tokens': max_new_tokens, 'tokenizer_dir': tokenizer_dir,
             'models': [evaluate(m, examples, tokenizer_dir, max_new_tokens) for m in models]}
  print(table(results['models']))
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + '.partial', 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1, ensure_ascii=False)
    os.replace(out + '.partial', out)
    log(f'wrote {out}')
  return results


def define_flags():
  flags.DEFINE_multi_string('model', None, 'A checkpoint step or directory, or an HF model directory; repeat for '
                            'one column each.')
  flags.DEFINE_string('data', None, 'SFT records: .jsonl/.json/.arrow (e.g. .data/chitchat/val.jsonl).')
  flags.DEFINE_integer('limit', None, 'Evaluate the first N records (default: all).')
  flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate at most per reply.')
  flags.DEFINE_string('tokenizer_dir', None, 'An HF directory with tokenizer.json (default: each model\'s).')
  flags.DEFINE_string('out', None, 'Write the metrics and per-record replies as JSON here.')
  flags.mark_flags_as_required(['model', 'data'])


def main(argv):
  """Errors a user can fix end in one line, exit 2 (user_errors.py)."""
  user_errors.exit_on_error(_main, argv, also=(ValueError,))


def _main(argv):
  tools.no_arguments(argv)
  run(FLAGS.model, FLAGS.data, FLAGS.limit, FLAGS.max_new_tokens, FLAGS.tokenizer_dir, FLAGS.out)


if __name__ == '__main__':
  define_flags()
  app.run(main)
