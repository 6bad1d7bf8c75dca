"""Pretraining text without preprocessing (data.source='text'): `.jsonl` / `.parquet` files,
tokenized as their samples are asked for.

A split's files (data.text.train / valid / test: paths or globs, taken in order) are one stream
of documents: each document's text (the JSON field or parquet column data.text.key) tokenized
with data.tokenizer, then the tokenizer's end-of-document id. Sample i is the tokens
[i·s, i·s + s + 1) of that stream (s = seq_length), the stream starting again at the first file
after the last: endless (samples_per_epoch None), and documents are never shuffled.

A window at any stream position finds its documents by a running index of each document's token
count and where it starts in its file (the byte offset of its line, or its row). The index grows
as positions are asked for, each document tokenized once on the way, and is saved under
data.index_mapping_dir (default index_cache/ beside the first file) keyed by the files' paths,
sizes and mtimes, the text key and the tokenizer's files: a restart reads the counts and
tokenizes only the documents its windows touch; a changed file or tokenizer misses the cache and
the index is rebuilt. Token arrays of recent documents are kept up to KEEP_TOKENS tokens.
"""
import glob
import hashlib
import os
import warnings
from collections import OrderedDict

import numpy as np

from data import index_cache, text_files, tokenizer as tokenizers
from data.errors import DataError

SPLITS = ('train', 'valid', 'test')
FIX = {'train': 'set data.text.train',
       'valid': 'set data.text.valid, or trainer.limit_val_batches=0 (no validation)',
       'test': 'set data.text.test, or trainer.limit_test_batches=0'}
KEEP_TOKENS = 1 << 22   # tokens of recently read documents kept in memory
SAVE_EVERY = 1 << 16    # a partial index is saved after at least this many new documents
FORMAT = 1              # bump when the cache's layout changes: old caches then miss


def split_files(split, patterns) -> list:
  """The split's files: each pattern a path or a glob (its matches sorted), in the given order."""
  patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns or ())
  if not patterns:
    raise DataError(f'data.text.{split} is empty: the {split} split of the text source needs .jsonl / .parquet '
                    f'files; {FIX[split]}')
  files = []
  for pattern in patterns:
    if glob.has_magic(pattern):
      matches = sorted(glob.glob(pattern, recursive=True))
      if not matches:
        raise DataError(f'data.text.{split}: {pattern!r} matches no file; fix the pattern')
    elif not os.path.exists(pattern):
      raise DataError(f'{pattern}: no such file (data.text.{split}); point it at .jsonl / .parquet files')
    else:
      matches = [pattern]
    files += matches
  for path in files:
    if os.path.isdir(path):
      raise DataError(f'{path}: a directory (data.text.{split}); give its files, or a glob like {path}/*.jsonl')
    if not path.endswith(text_files.EXTENSIONS):
      raise DataError(f'{path}: unsupported file type (data.text.{split}); the text source reads .jsonl (one '
                      'JSON object per line) and .parquet')
  return files


class _Grown:
  """An int64 array appended to one value at a time (capacity doubles)."""

  def __init__(self, values=()):
    self.n, self.buf = len(values), np.zeros(max(16, 2 * len(values)), np.int64)
    self.buf[:self.n] = values

  def append(self, value):
    if self.n == len(self.buf):
      self.buf = np.concatenate([self.buf, np.zeros(len(self.buf), np.int64)])
    self.buf[self.n] = value
    self.n += 1

  def view(self):
    return self.buf[:self.n]


class TextSource:
  """Token windows of one split's text files; `samples(ids)` -> int64 [b, seq_length + 1]."""

  def __init__(self, config, split='train'):
    data = config.data
    if split not in SPLITS:
      raise DataError(f'the text source has splits {SPLITS}, not {split!r}')
    self.split, self.seq_length, self.key = split, data.seq_length, data.text.key
    if not isinstance(self.key, str) or not self.key:
      raise DataError(f'data.text.key={self.key!r}: name the JSON field / parquet column holding the text')
    self.files = split_files(split, data.text[split])
    if data.tokenizer.type == 'none':
      raise DataError('data.source=\'text\' tokenizes the text as it reads it, but data.tokenizer.type=\'none\'; '
                      'set data.tokenizer.type and data.tokenizer.model (the model\'s tokenizer)')
    self.tokenizer = tokenizers.load_tokenizer(data.tokenizer)
    self.eod_id, self.vocab_size = self.tokenizer.eod_id, config.model.vocab_size
    if self.eod_id is None or self.eod_id >= self.vocab_size:
      raise DataError(f'the text source ends each document with the tokenizer\'s end-of-document id, but '
                      f'{self.tokenizer.path} has {self.eod_id} (model.vocab_size={self.vocab_size}); use a '
                      'tokenizer with an EOS token inside the model\'s vocabulary')
    self.readers = [text_files.reader(path, self.key) for path in self.files]
    self.samples_per_epoch = None                       # endless: the files repeat
    self.cache_path = self._cache_path(data)
    self._load()
    self._kept, self._kept_tokens = OrderedDict(), 0    # doc -> int32 tokens, recent last
    self._cursor, self._next_doc = None, -1

  # --- the count index --------------------------------------------------------------

  def _cache_path(self, data):
    stats = [(os.path.abspath(p), st.st_size, st.st_mtime_ns) for p, st in ((p, os.stat(p)) for p in self.files)]
    tok = [_file_digest(data.tokenizer.get(k)) for k in ('model', 'vocab_file', 'merge_file')]
    stem = index_cache.digest(FORMAT, self.key, stats, data.tokenizer.type, tok, self.eod_id)
    directory = data.get('index_mapping_dir') or os.path.join(os.path.dirname(os.path.abspath(self.files[0])),
                                                              'index_cache')
    return os.path.join(directory, f'text-{os.path.basename(self.files[0])}-{stem}.npz')

  def _load(self):
    """The counts saved by an earlier run (or another rank), if any and whole; else none yet."""
    self.counts, self.starts, self.ends, self.file_first, self.done = _Grown(), _Grown(), _Grown(), [], False
    self._saved, self._writable = 0, True
    try:
      with np.load(self.cache_path) as f:
        counts, starts, file_first, done = f['counts'], f['starts'], f['file_first'], bool(f['done'])
    except (OSError, ValueError, KeyError):
      return
    if (len(counts) != len(starts) or len(file_first) > len(self.files) or (counts < 1).any()
        or list(file_first) != sorted(file_first) or (len(counts) and (not len(file_first) or file_first[0]))
        or (done and (not len(counts) or len(file_first) != len(self.files)))):
      return                                             # torn or foreign: rebuilt
    self.counts, self.starts, self.ends = _Grown(counts), _Grown(starts), _Grown(np.cumsum(counts))
    self.file_first, self.done, self._saved = [int(i) for i in file_first], done, len(counts)

  def _save(self):
    if not self._writable:
      return
    try:
      os.makedirs(os.path.dirname(self.cache_path), exist_ok=True)
      tmp = f'{self.cache_path}.tmp{os.getpid()}.npz'      # renamed into place: ranks never read a torn file
      np.savez(tmp, counts=self.counts.view(), starts=self.starts.view(),
               file_first=np.asarray(self.file_first, np.int64), done=np.asarray(self.done))
      os.replace(tmp, self.cache_path)
      self._saved = self.counts.n
    except OSError as e:
      self._writable = False
      warnings.warn(f'cannot save the text source\'s token counts to {self.cache_path} ({e}); a restart '
                    'tokenizes the stream up to its position again. Set data.index_mapping_dir to a writable folder.')

  def _counted(self, f, start, count):
    """Document `counts.n` (the next uncounted one) is in file f at `start` with `count` tokens."""
    if len(self.file_first) <= f:
      self.file_first.append(self.counts.n)
    self.counts.append(count)
    self.starts.append(start)
    self.ends.append(count + (self.ends.buf[self.ends.n - 1] if self.ends.n else 0))
    if self.counts.n - self._saved >= max(SAVE_EVERY, self._saved // 4):
      self._save()

  # --- documents --------------------------------------------------------------------

  def _documents(self, doc):
    """(file, start, text) of documents doc, doc + 1, ... to the end of the last file."""
    if doc < self.counts.n:
      f = int(np.searchsorted(self.file_first, doc, side='right')) - 1
      start, skip = int(self.starts.buf[doc]), 0
    elif doc:                # not counted yet: from the last counted one, skipped
      f, start, skip = len(self.file_first) - 1, int(self.starts.buf[doc - 1]), 1
    else:
      f, start, skip = 0, 0, 0
    for f in range(f, len(self.readers)):
      found = 0
      for start, text in self.readers[f].read(start):
        found += 1
        if found > skip:
          yield f, start, text
      if not found:
        raise DataError(f'{self.files[f]}: no documents (empty, or blank lines only); remove it from '
                        f'data.text.{self.split}')
      start, skip = 0, 0

  def _tokens(self, doc):
    """Document doc's tokens, EOD last (int32); None past the last document of the files."""
    if doc in self._kept:
      self._kept.move_to_end(doc)
      return self._kept[doc]
    cursor = self._cursor if self._next_doc == doc else self._documents(doc)
    self._next_doc = -1         # until this read succeeds: a reader's error ends its generator
    item = next(cursor, None)
    if item is None:
      if doc != self.counts.n:
        raise DataError(f'document {doc} of {", ".join(self.files)} is gone: a file changed while the run read '
                        'it; restart the run (its token counts are then rebuilt)')
      self.done = True
      self._save()
      return None
    f, start, text = item
    self._cursor, self._next_doc = cursor, doc + 1
    tokens = np.asarray(self.tokenizer.encode(text) + [self.eod_id], np.int32)
    top = int(tokens.max())
    if top >= self.vocab_size:
      raise DataError(f'{self.readers[f].where(start)}: token id {top} is beyond model.vocab_size={self.vocab_size} '
                      f'({self.tokenizer.path}); use the model\'s tokenizer or raise model.vocab_size')
    if doc == self.counts.n:
      self._counted(f, start, len(tokens))
    self._kept[doc] = tokens
    self._kept_tokens += len(tokens)
    while self._kept_tokens > KEEP_TOKENS and len(self._kept) > 1:
      self._kept_tokens -= len(self._kept.popitem(last=False)[1])
    return tokens

  def _locate(self, pos):
    """(document, offset in it) of stream position pos, counting documents as far as needed."""
    while not self.done and (not self.ends.n or pos >= self.ends.buf[self.ends.n - 1]):
      self._tokens(self.counts.n)
    ends = self.ends.view()
    if self.done:
      pos %= int(ends[-1])
    doc = int(np.searchsorted(ends, pos, side='right'))
    return doc, pos - int(ends[doc] - self.counts.buf[doc])

  def samples(self, sample_ids) -> np.ndarray:
    """int64 [len(sample_ids), seq_length + 1]: tokens [i·s, i·s + s + 1) of the stream for each i."""
    ids = np.asarray(sample_ids, np.int64).reshape(-1)
    out = np.empty((len(ids), self.seq_length + 1), np.int64)
    for row, i in enumerate(ids):
      pos, filled = int(i) * self.seq_length, 0
      while filled < self.seq_length + 1:
        doc, offset = self._locate(pos + filled)
        piece = self._tokens(doc)[offset:offset + self.seq_length + 1 - filled]
        out[row, filled:filled + len(piece)] = piece
        filled += len(piece)
    return out


def _file_digest(path):
  """A hash of the file's bytes (None for no file): the cache follows the tokenizer's contents."""
  if not path or not os.path.isfile(path):
    return None
  h = hashlib.blake2b(digest_size=8)
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def main(argv=None):
  """python -m data.text FILE... --tokenizer=tok.model: how fast the source serves a first pass
  (tokenizing every document, nothing cached), in tokens and documents per second."""
  import argparse
  import tempfile
  import time
  from ml_collections import config_dict
  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument('files', nargs='+')
  parser.add_argument('--tokenizer', required=True, help='a SentencePiece .model')
  parser.add_argument('--seq_length', type=int, default=128)
  parser.add_argument('--batch', type=int, default=8, help='samples per request (a micro batch)')
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as cache:
    config = config_dict.ConfigDict({
        'model': {'vocab_size': 1 << 30},
        'data': {'seq_length': args.seq_length, 'index_mapping_dir': cache, 'text': {'train': args.files, 'key': 'text'},
                 'tokenizer': {'type': 'sentencepiece', 'model': args.tokenizer}}})
    source, first, start = TextSource(config), 0, time.perf_counter()
    while not source.done:
      source.samples(np.arange(first, first + args.batch))
      first += args.batch
    seconds, tokens = time.perf_counter() - start, int(source.ends.view()[-1])
  print(f'{source.counts.n} documents, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tokens/s, '
        f'{source.counts.n / seconds:,.0f} documents/s ({args.seq_length + 1}-token windows, {args.batch} a request)')


if __name__ == '__main__':
  main()
