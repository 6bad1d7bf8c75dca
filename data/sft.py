"""Supervised fine-tuning data, as NxD Training takes it: records, examples, packed rows.

Records (`read_records`, data/sft_records.py) come from a `datasets` save_to_disk directory, `.jsonl` / `.json`
(JSON lines or a JSON list) / `.arrow` files, or a directory of such files. Each is one of
  {"input": str, "output": str}        [bos] input output [eos]; loss on output and eos
  {"messages": [{"role", "content"}]}  the tokenizer's chat template; loss on the assistant
                                       turns (data/chat.py)
  {"input_ids", "loss_mask" | "labels"} pre-tokenized, taken as it is; both per token of
                                       input_ids: loss_mask 1 / labels != -100 = a target
Other keys are ignored; null counts as absent.

Examples (`tokenize`) are (ids, target): target[t] = 1 where token t is trained on. Rows
(`Rows`) hold seq_length + 1 tokens; the loop reads tokens = row[:-1], labels = row[1:].
Packing places examples in order, next-fit, as many as fit in a row; positions restart and
attention stays inside each example (segment_ids), and the label that crosses from one
example to the next is masked, so a packed row trains exactly what the examples would train
one per row. Longer examples keep their start and are counted (`Truncation`).

`SFTSource(config, split)` gives micro batches with the loader's keys; sample i of the split is
row order[i % n] with the order a permutation keyed by (seed, split, epoch = i // n).
"""
import os
import typing

import numpy as np
import torch

from data import chat
from data import tokenizer as tokenizers
from data.errors import DataError
from data.sft_records import Record, read_records, record_kind  # pylint: disable=unused-import  (the SFT API)
from rng import key_to_seed  # the project's keyed RNG (one line to change if it moves)

SPLIT_DIRS = {'train': 'train_dir', 'valid': 'val_dir', 'validation': 'val_dir', 'val': 'val_dir',
              'test': 'test_dir'}


def settings(config) -> dict:
  """The SFT keys (data.train_dir, val_dir, test_dir, dev_choose_samples; model_alignment_strategy.sft)."""
  data = config.data
  return {'train_dir': data.train_dir, 'val_dir': data.val_dir, 'test_dir': data.test_dir,
          'dev_choose_samples': data.dev_choose_samples, 'seq_length': data.seq_length,
          'packing': config.model_alignment_strategy.sft.packing, 'tokenizer': data.tokenizer,
          'seed': config.seed}


# --- examples ----------------------------------------------------------------------


def tokenize(records, tokenizer, template=None, special_tokens=None) -> list:
  """[(ids int64 [n], target int8 [n])], target 1 on the tokens trained on."""
  return [_tokenize(r, tokenizer, template, special_tokens or {}) for r in records]


def _tokenize(record, tokenizer, template, special):
  kind, f = record_kind(record), record.fields
  if kind == 'tokens':
    ids = np.asarray(f['input_ids'], np.int64)
    if 'loss_mask' in f:
      return ids, np.asarray(f['loss_mask']).astype(np.int8)
    return ids, (np.asarray(f['labels']) != -100).astype(np.int8)
  if tokenizer is None:
    raise DataError(f'{record.where}: text records need a tokenizer; set data.tokenizer.type '
                    'and data.tokenizer.model')
  if kind == 'prompt':
    return _prompt_example(record.where, f['input'], f['output'], tokenizer)
  if template is None:
    raise DataError(f'{record.where}: a chat record, but the tokenizer has no chat template; '
                    'add "chat_template" to the tokenizer_config.json beside data.tokenizer.model '
                    '(or a chat_template.jinja file)')
  import jinja2
  try:
    return chat.encode_chat(tokenizer, template, f['messages'], **special)
  except (DataError, jinja2.TemplateError) as e:
    raise DataError(f'{record.where}: {e}') from None


def _prompt_example(where, prompt, output, tokenizer):
  if tokenizer.eos_id is None:
    raise DataError(f'{where}: input/output examples end with EOS, but the tokenizer has none; '
                    'set eos_token in its tokenizer_config.json')
  # Tokenized apart, so the prompt/output boundary is a token boundary.
  head = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
  tail = tokenizer.encode(output) + [tokenizer.eos_id]
  target = np.concatenate([np.zeros(len(head), np.int8), np.ones(len(tail), np.int8)])
  return np.asarray(head + tail, np.int64), target


# --- rows --------------------------------------------------------------------------


class Truncation(typing.NamedTuple):
  truncated: int     # examples longer than seq_length + 1
  examples: int
  tokens_cut: int

  def __str__(self):
    return (f'truncated {self.truncated} of {self.examples} examples '
            f'({self.tokens_cut} tokens cut)')


def truncate(examples, seq_length):
  """Each example cut to its first seq_length + 1 tokens, and the count of what was cut."""
  keep = seq_length + 1
  cut = [max(len(ids) - keep, 0) for ids, _ in examples]
  stats = Truncation(sum(c > 0 for c in cut), len(examples), sum(cut))
  return [(ids[:keep], target[:keep]) for ids, target in examples], stats


def pack(lengths, capacity, packing=True) -> np.ndarray:
  """Row bounds: row r holds examples [bounds[r], bounds[r + 1]), placed in order, next-fit
  (a new row when the next example does not fit), or one example per row."""
  if not packing:
    return np.arange(len(lengths) + 1)
  bounds, used = [0], 0
  for i, n in enumerate(lengths):
    if used + n > capacity and i > bounds[-1]:
      bounds.append(i)
      used = 0
    used += n
  if len(lengths):
    bounds.append(len(lengths))
  return np.asarray(bounds)


class Rows:
  """Examples in rows of seq_length + 1 tokens; a row's fields are built when it is read."""

  def __init__(self, examples, seq_length, packing=True, pad_id=0):
    examples, self.truncation = truncate(examples, seq_length)
    self.seq_length, self.pad_id = seq_length, pad_id
    lengths = [len(ids) for ids, _ in examples]
    self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    # int32 halves the memory of a large set; ids are int64 again in the rows.
    self.ids = np.concatenate([ids for ids, _ in examples] or [np.zeros(0, np.int64)],
                              dtype=np.int32, casting='same_kind')
    self.target = np.concatenate([t for _, t in examples] or [np.zeros(0, np.int8)])
    self.bounds = pack(lengths, seq_length + 1, packing)

  def __len__(self):
    return len(self.bounds) - 1

  def examples_in(self, r):
    """Indices of the examples in row r; example k of the row has segment id k."""
    return np.arange(self.bounds[r], self.bounds[r + 1])

  def row(self, r) -> dict:
    """tokens, labels, loss_mask, position_ids, segment_ids of row r: numpy [seq_length]."""
    first, last = self.bounds[r], self.bounds[r + 1]
    lo, hi = self.starts[first], self.starts[last]
    pad = self.seq_length + 1 - (hi - lo)
    ids = np.concatenate([self.ids[lo:hi], np.full(pad, self.pad_id)]).astype(np.int64)
    target = np.concatenate([self.target[lo:hi], np.zeros(pad, np.int8)])
    # The padding is one more segment: it attends only to itself, real tokens never to it.
    lengths = np.append(np.diff(self.starts[first:last + 1]), pad)
    segment = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    # A label is trained when it is a target of the same example as its input token: the
    # step from one packed example's last token to the next one's first is not.
    trained = (target[1:] == 1) & (segment[1:] == segment[:-1])
    return {'tokens': ids[:-1], 'labels': ids[1:], 'loss_mask': trained.astype(np.float32),
            'position_ids': position[:-1], 'segment_ids': segment[:-1]}

  def batch(self, rows) -> dict:
    """The rows' fields stacked: numpy [len(rows), seq_length]."""
    built = [self.row(int(r)) for r in rows]
    return {k: np.stack([b[k] for b in built]) for k in built[0]}

  def fill(self) -> float:
    """Fraction of row tokens that are real (not padding)."""
    return len(self.ids) / max(len(self) * (self.seq_length + 1), 1)


class SFTSource:
  """A split's SFT rows and micro batches for the loader (same keys as its other sources)."""

  def __init__(self, config, split='train', records=None):
    """`records`: pre-tokenized ones to use instead of the split's files (data/stand_in.py)."""
    s = settings(config)
    if split not in SPLIT_DIRS:
      raise DataError(f'SFT data has splits {sorted(SPLIT_DIRS)}, not {split!r}')
    self.path, self.split, self.seed = s[SPLIT_DIRS[split]], split, s['seed']
    tokenizer, template, special = load_chat_tokenizer(s['tokenizer'] if records is None else None)
    records = read_records(self.path, s['dev_choose_samples']) if records is None else records
    if not records:
      raise DataError(f'{self.path}: no SFT records; add some or point data.'
                      f'{SPLIT_DIRS[split]} elsewhere')
    examples = tokenize(records, tokenizer, template, special)
    _check_ids(self.path, examples, config.model.vocab_size)
    # pre-tokenized sequences trained on every token are pretraining data (NxD's HF pretraining)
    self.kind = ('pretraining' if all('input_ids' in r.fields for r in records) and all(t.all() for _, t in examples)
                 else 'SFT')
    self.rows = Rows(examples, s['seq_length'], s['packing'], _pad_id(tokenizer))
    self.truncation = self.rows.truncation
    self.samples_per_epoch = len(self.rows)
    self._orders = {}

  def summary(self) -> str:
    """The line the loader logs about this split."""
    return (f'{self.kind} {self.split}: {self.truncation.examples} examples from {self.path} in '
            f'{len(self.rows)} rows ({self.rows.fill():.0%} tokens, the rest padding); '
            f'{self.truncation}')

  def order(self, epoch) -> np.ndarray:
    """Epoch `epoch`'s permutation of the rows: a pure function of (seed, split, epoch)."""
    if epoch not in self._orders:
      generator = np.random.default_rng(key_to_seed(self.seed, 'sft', self.split, int(epoch)))
      self._orders = {epoch: generator.permutation(len(self.rows))}   # one epoch at a time
    return self._orders[epoch]

  def row_ids(self, sample_ids) -> np.ndarray:
    epochs, within = np.divmod(np.asarray(sample_ids, np.int64), len(self.rows))
    return np.array([self.order(e)[w] for e, w in zip(epochs, within)], np.int64)

  def micro_batch(self, sample_ids) -> dict:
    batch = {k: torch.from_numpy(v) for k, v in self.rows.batch(self.row_ids(sample_ids)).items()}
    batch['sample_ids'] = torch.as_tensor(np.asarray(sample_ids), dtype=torch.int64)
    return batch


def load_chat_tokenizer(tokenizer_cfg):
  """(tokenizer, chat template or None, special tokens) from config.data.tokenizer; no
  tokenizer (type 'none') is fine for pre-tokenized data."""
  if tokenizer_cfg is None or tokenizer_cfg.get('type', 'none') == 'none':
    return None, None, {}
  tokenizer = tokenizers.load_tokenizer(tokenizer_cfg)
  directory = os.path.dirname(os.path.abspath(tokenizer.path))
  return tokenizer, chat.load_template(directory), chat.special_tokens(directory)


def _pad_id(tokenizer):
  # Padding is never attended to nor trained on; any id in the vocabulary serves.
  if tokenizer is None:
    return 0
  return next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)


def _check_ids(path, examples, vocab_size):
  top = max((int(ids.max()) for ids, _ in examples if len(ids)), default=-1)
  if top >= vocab_size:
    raise DataError(f'{path}: token id {top} is beyond model.vocab_size = {vocab_size}; '
                    'tokenize with the model\'s tokenizer or raise model.vocab_size')
