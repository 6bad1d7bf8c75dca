"""Tokenize text into a Megatron indexed dataset (`<output_prefix>.bin` + `.idx`).

  python -m tools.preprocess --input corpus.jsonl --json-key text \\
      --tokenizer-type sentencepiece --tokenizer-model tok.model --output-prefix data/corpus

--input takes files or glob patterns (`--input a.jsonl 'b/*.txt'`; or repeat --input).
Inputs are JSONL (one document per line, text under --json-key; chosen by --json-key or a
.jsonl/.json suffix) or plain text (each file one document, or one per paragraph/line with
--text-docs). Every document ends with the tokenizer's end-of-document token. Output order
is input order whatever the number of workers, so the result is reproducible.
"""
import glob
import itertools
import multiprocessing as mp
import os
import sys
import time

from absl import app, flags
import numpy as np

import tools
import user_errors
from data import indexed, sft_records, tokenizer
from data.errors import DataError

FLAGS = flags.FLAGS
BATCH_DOCS = 64   # documents per task sent to a worker: amortizes the pickling round trip


def expand_inputs(patterns) -> list:
  files = []
  for pattern in patterns:
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    for match in matches or [pattern]:
      if os.path.isdir(match):
        raise DataError(f'preprocess: input {match!r} is a directory; name its files (e.g. --input=\'{match}/*.jsonl\')')
      if not os.path.isfile(match):
        raise FileNotFoundError(f'preprocess: input {pattern!r} does not exist')
    files.extend(matches)
  return files


def read_documents(files, json_key, text_docs):
  """Yields document texts, file by file, in order."""
  for path in files:
    if json_key or path.endswith(('.jsonl', '.json')):
      yield from _jsonl_documents(path, json_key or 'text')
      continue
    with open(path, encoding='utf-8') as f:
      text = f.read()
    separator = {'file': None, 'paragraph': '\n\n', 'line': '\n'}[text_docs]
    docs = text.split(separator) if separator else [text]
    # Blank documents are skipped in every mode: a blank file is no document either.
    yield from (d for d in docs if d.strip())


def _jsonl_documents(path, key):
  for where, record in sft_records.read_json_lines(path):
    if not isinstance(record, dict) or key not in record:
      raise DataError(f'{where}: no {key!r} field; set --json-key to the field holding the text')
    if not isinstance(record[key], str):
      raise DataError(f'{where}: field {key!r} holds {type(record[key]).__name__}, not text; set '
                      '--json-key to the field holding the text')
    yield record[key]


# Worker side: one tokenizer per process, loaded once by the pool initializer.
_worker = {}


def _init_worker(tok_cfg, dtype, append_eod):
  tok = tokenizer.load_tokenizer(tok_cfg)
  _worker.update(tok=tok, dtype=dtype, eod=[tok.eod_id] if append_eod else [])


def _encode_batch(texts) -> list:
  tok, dtype, eod = _worker['tok'], _worker['dtype'], _worker['eod']
  return [np.asarray(tok.encode(t) + eod, dtype) for t in texts]


def _batches(iterable, n):
  it = iter(iterable)
  while batch := list(itertools.islice(it, n)):
    yield batch


class Progress:
  """Documents, tokens and their rates: one self-overwriting line on a terminal, else a line
  every few seconds (so logs stay readable)."""

  def __init__(self, quiet):
    self.quiet = quiet
    self.tty = sys.stderr.isatty()
    self.every_s = 0.5 if self.tty else 5.0
    self.start = self.last = time.perf_counter()
    self.docs = self.tokens = 0

  def update(self, docs, tokens, final=False):
    self.docs += docs
    self.tokens += tokens
    now = time.perf_counter()
    if self.quiet or (now - self.last < self.every_s and not final):
      return
    self.last = now
    dt = max(now - self.start, 1e-9)
    line = (f'{self.docs:,} docs ({self.docs / dt:,.0f} docs/s) | {self.tokens:,} tokens '
            f'({self.tokens / dt:,.0f} tokens/s) | {dt:.1f} s')
    sys.stderr.write(f'\r{line}' + ('\n' if final else '') if self.tty else line + '\n')
    sys.stderr.flush()


def preprocess(files, output_prefix, tok_cfg, json_key=None, text_docs='file', workers=1,
               append_eod=True, quiet=False) -> dict:
  """Tokenizes the files into output_prefix.{bin,idx}; returns the summary numbers."""
  files = expand_inputs(files)
  tok = tokenizer.load_tokenizer(tok_cfg)
  if append_eod and tok.eod_id is None:
    raise DataError('preprocess: the tokenizer has no end-of-document (EOS) token; '
                    'pass --no-append-eod to write documents without one')
  dtype = indexed.dtype_for_vocab(tok.vocab_size)
  batches = _batches(read_documents(files, json_key, text_docs), BATCH_DOCS)
  init_args = (tok_cfg, dtype, append_eod)
  progress = Progress(quiet)
  with indexed.IndexedDatasetWriter(output_prefix, dtype) as writer:
    if workers <= 1:
      _init_worker(*init_args)
      results = map(_encode_batch, batches)
      _write_all(results, writer, progress)
    else:
      ctx = mp.get_context('spawn')   # fork is unsafe with threaded libraries already loaded
      with ctx.Pool(workers, _init_worker, init_args) as pool:
        _write_all(pool.imap(_encode_batch, batches), writer, progress)
    if progress.docs == 0:
      # Raised inside the writer so that it deletes the empty .bin/.idx: a dataset with no
      # documents would only fail later, at training start, far from its cause.
      raise DataError(f'preprocess: no documents in {_names(files)} (empty, or blank lines '
                      'only); check --input, --json-key and --text-docs')
  progress.update(0, 0, final=True)
  seconds = time.perf_counter() - progress.start
  return {'files': len(files), 'documents': progress.docs, 'tokens': progress.tokens,
          'seconds': seconds, 'docs_per_s': progress.docs / seconds,
          'tokens_per_s': progress.tokens / seconds, 'dtype': np.dtype(dtype).name,
          'vocab_size': tok.vocab_size, 'bin_bytes': os.path.getsize(output_prefix + '.bin')}


def _names(files, shown=5) -> str:
  more = f' and {len(files) - shown} more' if len(files) > shown else ''
  return ', '.join(files[:shown]) + more


def _write_all(results, writer, progress):
  for docs in results:
    for doc in docs:
      writer.add_document(doc)
    progress.update(len(docs), sum(len(d) for d in docs))


def define_flags():
  flags.DEFINE_multi_string('input', None, 'A file or glob pattern; the arguments after it are more')
  flags.DEFINE_string('output-prefix', None, 'Writes <prefix>.bin and <prefix>.idx.')
  flags.DEFINE_string('json-key', None, 'JSONL field holding the text (default: text).')
  flags.DEFINE_enum('text-docs', 'file', ['file', 'paragraph', 'line'], 'Plain text: what one document is.')
  flags.DEFINE_enum('tokenizer-type', None, ['sentencepiece', 'huggingface', 'gpt2'], 'The tokenizer\'s kind.')
  flags.DEFINE_string('tokenizer-model', None, '.model (sentencepiece) or tokenizer.json.')
  flags.DEFINE_string('vocab-file', None, 'gpt2: vocab.json or encoder.json.')
  flags.DEFINE_string('merge-file', None, 'gpt2: merges.txt or vocab.bpe.')
  flags.DEFINE_bool('no-append-eod', False, 'Do not end documents with EOD.')
  flags.DEFINE_integer('workers', os.cpu_count() or 1, 'Tokenizing processes.')
  flags.DEFINE_bool('quiet', False, 'No progress line.')
  flags.mark_flags_as_required(['output-prefix', 'tokenizer-type'])


def summary(output_prefix, s) -> str:
  return (f'wrote {output_prefix}.bin/.idx: {s["documents"]:,} documents, {s["tokens"]:,} {s["dtype"]} tokens '
          f'({s["bin_bytes"] / 2**20:.1f} MiB) from {s["files"]} file(s) in {s["seconds"]:.1f} s: '
          f'{s["docs_per_s"]:,.0f} docs/s, {s["tokens_per_s"]:,.0f} tokens/s')


def main(argv):
  """Errors a user can fix end in one line, exit 2 (user_errors.py)."""
  user_errors.exit_on_error(_main, argv)


def _main(argv):
  def value(name):            # the flags' names are Megatron's, with dashes: not attributes
    return FLAGS[name].value

  # absl gives a flag one value: a shell-expanded `--input books/*.txt` leaves the rest as arguments.
  inputs = (value('input') or []) + argv[1:]
  if not inputs:
    tools.fail('no input: name the files (or glob patterns) with --input')
  tok_cfg = {'type': value('tokenizer-type'), 'model': value('tokenizer-model'),
             'vocab_file': value('vocab-file'), 'merge_file': value('merge-file')}
  s = preprocess(inputs, value('output-prefix'), tok_cfg, value('json-key'), value('text-docs'),
                 value('workers'), not value('no-append-eod'), value('quiet'))
  print(summary(value('output-prefix'), s))


if __name__ == '__main__':
  define_flags()
  app.run(main)
