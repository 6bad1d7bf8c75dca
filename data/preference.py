"""Preference pairs for DPO and ORPO: records, tokenized pairs, one pair per row.

Records are read as SFT records are (data/sft_records.py: save_to_disk, .jsonl/.json/.arrow or
a directory of them), each one of
  {"prompt": str, "chosen": str, "rejected": str}   [bos] prompt | response [eos]
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
        trl's conversational form: the prompt is the chat template's rendering of its messages
        with the generation prompt; a response is what rendering prompt + response adds to it
        (token ids, checked to extend the prompt's), less the whitespace after the end of the
        turn, as data/chat.py's assistant mask
  {"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}   pre-tokenized, as they are
Other keys are ignored; null counts as absent.

A row (`PairRows`) holds one pair in seq_length + 1 tokens: prompt + chosen (segment 0), prompt +
rejected (segment 1), padding (segment 2); positions restart per segment, attention stays in
it, and the label crossing a boundary is masked, as in data/sft.py's packed rows. A pair that does
not fit has its prompt cut to max_prompt_length (keeping its start or end: truncation_mode, as
trl), then its responses' ends, and is counted (`Truncation`). chosen_mask / rejected_mask are 1
where the label is a response token (eos included) of that side; loss_mask = chosen_mask.
"""
import typing

import numpy as np

from data import chat, sft
from data.errors import DataError
from data.sft import _check_ids, _pad_id
from data.sft_records import Record, _int_array, _type, read_files  # pylint: disable=unused-import

OBJECTIVES = ('dpo', 'orpo')
TRUNCATION_MODES = ('keep_start', 'keep_end')
TEXT_KEYS = ('prompt', 'chosen', 'rejected')
TOKEN_KEYS = ('prompt_input_ids', 'chosen_input_ids', 'rejected_input_ids')
PAIR_FORMS = ('a preference record needs "prompt", "chosen" and "rejected" (all strings, or all '
              'lists of {"role", "content"} messages), or "prompt_input_ids", "chosen_input_ids" '
              'and "rejected_input_ids" (pre-tokenized)')


def settings(config) -> dict:
  """data.train_dir, val_dir, test_dir, dev_choose_samples, seq_length, tokenizer; max_prompt_length and
  truncation_mode from model_alignment_strategy.dpo or .orpo (by model.objective)."""
  objective, data = config.model.objective, config.data
  if objective not in OBJECTIVES:
    raise DataError(f'preference pairs train model.objective {" or ".join(OBJECTIVES)}, '
                    f'not {objective!r}')
  strategy = config.model_alignment_strategy[objective]
  key = f'model_alignment_strategy.{objective}'
  if strategy.truncation_mode not in TRUNCATION_MODES:
    raise DataError(f'{key}.truncation_mode is {strategy.truncation_mode!r}; use one of '
                    f'{", ".join(TRUNCATION_MODES)}')
  if not isinstance(strategy.max_prompt_length, int) or strategy.max_prompt_length < 1:
    raise DataError(f'{key}.max_prompt_length must be a positive number of tokens')
  return {'train_dir': data.train_dir, 'val_dir': data.val_dir, 'test_dir': data.test_dir, 'objective': objective,
          'dev_choose_samples': data.dev_choose_samples, 'seq_length': data.seq_length,
          'tokenizer': data.tokenizer, 'seed': config.seed,
          'max_prompt_length': strategy.max_prompt_length,
          'truncation_mode': strategy.truncation_mode}


# --- records and pairs ---------------------------------------------------------------


class Pair(typing.NamedTuple):
  prompt: np.ndarray      # int64 token ids
  chosen: np.ndarray
  rejected: np.ndarray
  where: str = ''         # the record's file and line, for errors


def read_pairs(path, limit=None) -> list:
  """The first `limit` (all when None) records under `path`, each checked (`pair_kind`)."""
  records = read_files(path, limit, 'preference', PAIR_FORMS)
  for record in records:
    pair_kind(record)
  return records


def pair_kind(record) -> str:
  """'text', 'chat' or 'tokens', after checking the record's types (DataError if wrong)."""
  where, f = record.where, record.fields
  if any(k in f for k in TOKEN_KEYS):
    for k in TOKEN_KEYS:
      ids = _int_array(where, k, f.get(k))
      if ids.min(initial=0) < 0 or (ids.size == 0 and k != 'prompt_input_ids'):
        raise DataError(f'{where}: "{k}" must be token ids >= 0 (non-empty for a response)')
    return 'tokens'
  if not any(k in f for k in TEXT_KEYS):
    raise DataError(f'{where}: {PAIR_FORMS}; this one has keys {sorted(f)}')
  if all(isinstance(f.get(k), str) for k in TEXT_KEYS):
    return 'text'
  if all(isinstance(f.get(k), list) for k in TEXT_KEYS):
    for k in TEXT_KEYS:
      _check_turns(where, k, f[k], assistant=k != 'prompt')
    return 'chat'
  got = ', '.join(f'"{k}" {_type(f.get(k))}' for k in TEXT_KEYS)
  raise DataError(f'{where}: "prompt", "chosen" and "rejected" must be all strings or all lists '
                  f'of messages; got {got}')


def _check_turns(where, key, messages, assistant):
  fix = f'"{key}" is a list of {{"role": str, "content": str}} messages'
  if not messages:
    raise DataError(f'{where}: "{key}" is an empty list; {fix}')
  for i, m in enumerate(messages):
    if not (isinstance(m, dict) and isinstance(m.get('role'), str)
            and isinstance(m.get('content'), str)):
      raise DataError(f'{where}: {key}[{i}] needs a string "role" and "content"; {fix}')
  if assistant and not any(m['role'] == 'assistant' for m in messages):
    raise DataError(f'{where}: "{key}" has no assistant message, so no response; {fix}')


def tokenize(records, tokenizer, template=None, special_tokens=None) -> list:
  """[Pair] of the records (checked by read_pairs)."""
  return [_pair(r, tokenizer, template, special_tokens or {}) for r in records]


def _pair(record, tokenizer, template, special):
  where, f, kind = record.where, record.fields, pair_kind(record)
  if kind == 'tokens':
    return Pair(*(np.asarray(f[k], np.int64) for k in TOKEN_KEYS), where)
  if tokenizer is None:
    raise DataError(f'{where}: text records need a tokenizer; set data.tokenizer.type and '
                    'data.tokenizer.model')
  if kind == 'text':
    if tokenizer.eos_id is None:
      raise DataError(f'{where}: responses end with EOS, but the tokenizer has none; set '
                      'eos_token in its tokenizer_config.json')
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt, chosen, rejected = (tokenizer.encode(f[k]) for k in TEXT_KEYS)
    return _arrays(bos + prompt, chosen + [tokenizer.eos_id], rejected + [tokenizer.eos_id], where)
  if template is None:
    raise DataError(f'{where}: a chat record, but the tokenizer has no chat template; add '
                    '"chat_template" to the tokenizer_config.json beside data.tokenizer.model')
  import jinja2
  try:
    prompt = chat.render(template, f['prompt'], add_generation_prompt=True, **special)
    # The newline after a turn's end is not generated (the next header follows it): cut it.
    full = [chat.render(template, f['prompt'] + f[k], **special).rstrip() for k in TEXT_KEYS[1:]]
  except (DataError, jinja2.TemplateError) as e:
    raise DataError(f'{where}: {e}') from None
  prompt = tokenizer.encode(prompt)
  responses = [_response(where, key, prompt, tokenizer.encode(text))
               for key, text in zip(TEXT_KEYS[1:], full)]
  return _arrays(prompt, *responses, where)


def _response(where, key, prompt, full):
  if full[:len(prompt)] != prompt or len(full) == len(prompt):
    raise DataError(
        f'{where}: the chat template\'s tokens of prompt + {key} do not extend (or add nothing '
        'to) those of the prompt with the generation prompt, so the response cannot be cut '
        'from them; pre-tokenize with prompt_input_ids / chosen_input_ids / rejected_input_ids')
  return full[len(prompt):]


def _arrays(prompt, chosen, rejected, where):
  return Pair(*(np.asarray(x, np.int64) for x in (prompt, chosen, rejected)), where)


# --- rows ----------------------------------------------------------------------------


class Truncation(typing.NamedTuple):
  prompts_cut: int     # pairs whose prompt was cut to max_prompt_length
  responses_cut: int   # pairs whose responses were cut as well
  pairs: int
  tokens_cut: int      # row tokens cut (a prompt counts twice: it is in both segments)

  def __str__(self):
    return (f'cut the prompt of {self.prompts_cut} and the responses of {self.responses_cut} '
            f'of {self.pairs} pairs ({self.tokens_cut} tokens cut)')


def fit(pair, seq_length, max_prompt_length, truncation_mode) -> Pair:
  """The pair cut so prompt + chosen + prompt + rejected fits seq_length + 1 tokens: the prompt
  to max_prompt_length first (its start or end kept), then the responses' ends."""
  prompt, chosen, rejected, where = pair
  room = seq_length + 1
  if 2 * len(prompt) + len(chosen) + len(rejected) <= room:
    return pair
  if len(prompt) > max_prompt_length:
    keep_start = truncation_mode == 'keep_start'
    prompt = prompt[:max_prompt_length] if keep_start else prompt[len(prompt) - max_prompt_length:]
  budget = room - 2 * len(prompt)
  if len(chosen) + len(rejected) > budget:
    if budget < 2:
      raise DataError(f'{where}: a prompt of {len(prompt)} tokens, twice, leaves no room for the '
                      f'responses in seq_length {seq_length}; lower max_prompt_length or raise '
                      'data.seq_length')
    # Each response gets half the room, or more where the other one needs less.
    keep = min(len(chosen), max(budget // 2, budget - len(rejected)))
    chosen, rejected = chosen[:keep], rejected[:budget - keep]
  return Pair(prompt, chosen, rejected, where)


class PairRows(sft.Rows):
  """One pair per row of seq_length + 1 tokens, its fields built when it is read."""

  def __init__(self, pairs, seq_length, max_prompt_length, truncation_mode, pad_id=0):
    fitted = [fit(p, seq_length, max_prompt_length, truncation_mode) for p in pairs]
    examples = []
    for pair in fitted:
      for response in (pair.chosen, pair.rejected):
        target = np.repeat(np.int8([0, 1]), [len(pair.prompt), len(response)])
        examples.append((np.concatenate([pair.prompt, response]), target))
    super().__init__(examples, seq_length, packing=False, pad_id=pad_id)
    self.bounds = np.arange(0, len(examples) + 1, 2)      # the two sides of a pair share a row
    sizes = [[len(x) for x in p[:3]] for p in pairs]
    kept = [[len(x) for x in p[:3]] for p in fitted]
    self.truncation = Truncation(
        sum(a[0] > b[0] for a, b in zip(sizes, kept)),
        sum(a[1:] != b[1:] for a, b in zip(sizes, kept)), len(pairs),
        sum(2 * a[0] + a[1] + a[2] - 2 * b[0] - b[1] - b[2] for a, b in zip(sizes, kept)))

  def row(self, r) -> dict:
    """tokens, labels, position_ids, segment_ids, chosen_mask, rejected_mask, loss_mask of row
    r: numpy [seq_length]."""
    row = super().row(r)
    trained = row.pop('loss_mask')
    row['chosen_mask'] = trained * (row['segment_ids'] == 0)
    row['rejected_mask'] = trained * (row['segment_ids'] == 1)
    row['loss_mask'] = row['chosen_mask']
    return row


class PreferenceSource(sft.SFTSource):
  """A split's pair rows and micro batches for the loader; the epoch order, row_ids and
  micro_batch are SFTSource's (a permutation keyed by (seed, split, epoch))."""

  def __init__(self, config, split='train', records=None):  # pylint: disable=super-init-not-called
    """`records`: pre-tokenized pairs to use instead of the split's files (data/stand_in.py)."""
    s = settings(config)
    if not s['train_dir']:
      raise DataError(f'model.objective={s["objective"]} trains on preference pairs; set '
                      'data.train_dir (and data.val_dir) to their records')
    if split not in sft.SPLIT_DIRS:
      raise DataError(f'preference data has splits {sorted(sft.SPLIT_DIRS)}, not {split!r}')
    self.path, self.split, self.seed = s[sft.SPLIT_DIRS[split]], split, s['seed']
    self.objective = s['objective']
    tokenizer, template, special = sft.load_chat_tokenizer(s['tokenizer'] if records is None else None)
    records = read_pairs(self.path, s['dev_choose_samples']) if records is None else records
    if not records:
      raise DataError(f'{self.path}: no preference records; add some or point data.'
                      f'{sft.SPLIT_DIRS[split]} elsewhere')
    pairs = tokenize(records, tokenizer, template, special)
    _check_ids(self.path, [(np.concatenate(p[:3]), None) for p in pairs], config.model.vocab_size)
    self.rows = PairRows(pairs, s['seq_length'], s['max_prompt_length'], s['truncation_mode'],
                         _pad_id(tokenizer))
    self.truncation = self.rows.truncation
    self.samples_per_epoch = len(self.rows)
    self._orders = {}

  def summary(self) -> str:
    return (f'{self.objective.upper()} {self.split}: {self.truncation.pairs} preference pairs from '
            f'{self.path}, one per row ({self.rows.fill():.0%} tokens, the rest padding); '
            f'{self.truncation}')
