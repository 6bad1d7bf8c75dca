"""Tokenize text into a Megatron indexed dataset (`<output_prefix>.bin` + `.idx`).

  python tools/preprocess.py --input corpus.jsonl --json-key text \\
      --tokenizer-type sentencepiece --tokenizer-model tok.model --output-prefix data/corpus

Inputs are JSONL (one document per line, text under --json-key; chosen by --json-key or a
.jsonl/.json suffix) or plain text (each file one document, or one per paragraph/line with
--text-docs). Every document ends with the tokenizer's end-of-document token. Output order
is input order whatever the number of workers, so the result is reproducible.
"""
import argparse
import glob
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import indexed, tokenizer  # noqa: E402
from data.errors import DataError  # noqa: E402

BATCH_DOCS = 64   # documents per task sent to a worker: amortizes the pickling round trip


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--input', nargs='+', required=True, help='files or glob patterns')
  p.add_argument('--output-prefix', required=True)
  p.add_argument('--json-key', default=None, help='JSONL field holding the text (default: text)')
  p.add_argument('--text-docs', choices=('file', 'paragraph', 'line'), default='file',
                 help='plain text: what one document is')
  p.add_argument('--tokenizer-type', required=True,
                 choices=('sentencepiece', 'huggingface', 'gpt2'))
  p.add_argument('--tokenizer-model', help='.model (sentencepiece) or tokenizer.json')
  p.add_argument('--vocab-file', help='gpt2: vocab.json or encoder.json')
  p.add_argument('--merge-file', help='gpt2: merges.txt or vocab.bpe')
  p.add_argument('--no-append-eod', action='store_true', help='do not end documents with EOD')
  p.add_argument('--workers', type=int, default=os.cpu_count() or 1)
  p.add_argument('--quiet', action='store_true', help='no progress line')
  return p.parse_args(argv)


def expand_inputs(patterns) -> list:
  files = []
  for pattern in patterns:
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not matches or not all(os.path.isfile(m) for m in matches):
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
  with open(path, encoding='utf-8') as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f'{path}:{line_no}: not valid JSON ({e.msg}); fix or remove the '
                        'line') from None
      if not isinstance(record, dict) or key not in record:
        raise DataError(f'{path}:{line_no}: no {key!r} field; set --json-key to the field '
                        'holding the text')
      if not isinstance(record[key], str):
        kind = type(record[key]).__name__
        raise DataError(f'{path}:{line_no}: field {key!r} holds {kind}, not text; set '
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


def main(argv=None):
  args = parse_args(argv)
  tok_cfg = {'type': args.tokenizer_type, 'model': args.tokenizer_model,
             'vocab_file': args.vocab_file, 'merge_file': args.merge_file}
  try:
    s = preprocess(args.input, args.output_prefix, tok_cfg, args.json_key, args.text_docs,
                   args.workers, not args.no_append_eod, args.quiet)
  except (DataError, FileNotFoundError) as e:
    # Bad input, named with its fix: one line, argparse's exit status for a usage error.
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(f'wrote {args.output_prefix}.bin/.idx: {s["documents"]:,} documents, {s["tokens"]:,} '
        f'{s["dtype"]} tokens ({s["bin_bytes"] / 2**20:.1f} MiB) from {s["files"]} file(s) in '
        f'{s["seconds"]:.1f} s: {s["docs_per_s"]:,.0f} docs/s, {s["tokens_per_s"]:,.0f} tokens/s')


if __name__ == '__main__':
  main()
