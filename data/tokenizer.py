"""One tokenizer interface over SentencePiece `.model`, Hugging Face `tokenizer.json` and
GPT-2 BPE files (`vocab.json` + `merges.txt`, or OpenAI's `encoder.json` + `vocab.bpe`).

`load_tokenizer(config.data.tokenizer)` returns an object with
  encode(text) -> list[int]   (no BOS/EOS added: preprocessing appends the EOD itself)
  decode(ids) -> str
  vocab_size, bos_id, eos_id, pad_id, eod_id   (None where the tokenizer has no such token)
The end-of-document id is the EOS id, as in Megatron's tokenizers.
"""
import json
import os

from data.errors import DataError

GPT2_EOT = '<|endoftext|>'
# Special-token spellings of the common families, tried when tokenizer_config.json is absent.
BOS_NAMES = ('<s>', '<|begin_of_text|>', '<bos>', '[BOS]', GPT2_EOT)
EOS_NAMES = ('</s>', '<|end_of_text|>', '<eos>', '[EOS]', GPT2_EOT)
PAD_NAMES = ('<pad>', '<|pad|>', '[PAD]', '<|finetune_right_pad_id|>')


def _field(cfg, name):
  return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def _require_file(path, what):
  if not path:
    raise DataError(f'tokenizer: {what} is not set; set it to the tokenizer file')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'tokenizer: {what} {path!r} does not exist')
  return path


class SentencePieceTokenizer:

  def __init__(self, model_file):
    import sentencepiece as spm
    self.path = _require_file(model_file, 'data.tokenizer.model (a SentencePiece .model)')
    self.sp = spm.SentencePieceProcessor(model_file=model_file)
    self.vocab_size = self.sp.get_piece_size()
    self.bos_id, self.eos_id, self.pad_id = (
        i if i >= 0 else None for i in (self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()))
    self.eod_id = self.eos_id

  def encode(self, text: str) -> list:
    return self.sp.encode(text)

  def decode(self, ids) -> str:
    return self.sp.decode(list(map(int, ids)))


class HuggingFaceTokenizer:
  """A `tokenizers.Tokenizer`; special ids from a sibling tokenizer_config.json if present."""

  def __init__(self, tokenizer_json=None, tok=None, special=None):
    from tokenizers import Tokenizer
    if tok is None:
      self.path = _require_file(tokenizer_json, 'data.tokenizer.model (a tokenizer.json)')
      tok = Tokenizer.from_file(tokenizer_json)
      special = special or _special_tokens_from_config(os.path.dirname(tokenizer_json))
    self.tok = tok
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    special = special or {}
    self.bos_id = self._find(special.get('bos_token'), BOS_NAMES)
    self.eos_id = self._find(special.get('eos_token'), EOS_NAMES)
    self.pad_id = self._find(special.get('pad_token'), PAD_NAMES)
    self.eod_id = self.eos_id

  def _find(self, configured, fallbacks):
    for name in ([configured] if configured else []) + list(fallbacks):
      i = self.tok.token_to_id(name)
      if i is not None:
        return i
    return None

  def encode(self, text: str) -> list:
    return self.tok.encode(text, add_special_tokens=False).ids

  def encode_offsets(self, text: str):
    """(ids as encode, [(start, end)] character span of each token in `text`).

    Spans come from a copy without the post-processor: its ByteLevel trim_offsets shrinks
    whitespace tokens to empty spans, and without special tokens added it changes no id.
    """
    if getattr(self, '_untrimmed', None) is None:
      from tokenizers import Tokenizer
      self._untrimmed = Tokenizer.from_str(self.tok.to_str())
      self._untrimmed.post_processor = None
    encoding = self._untrimmed.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def decode(self, ids) -> str:
    return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)


def _special_tokens_from_config(directory) -> dict:
  path = os.path.join(directory, 'tokenizer_config.json')
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    try:
      cfg = json.load(f)
    except json.JSONDecodeError as e:
      raise DataError(f'{path}: not valid JSON ({e}); fix or delete it (the special tokens '
                      'then come from their usual names)') from None
  out = {}
  for key in ('bos_token', 'eos_token', 'pad_token'):
    value = cfg.get(key)
    out[key] = value.get('content') if isinstance(value, dict) else value
  return out


def gpt2_bpe(vocab_file, merge_file) -> HuggingFaceTokenizer:
  """GPT-2's byte-level BPE from its two files, built with the `tokenizers` library."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  _require_file(vocab_file, 'data.tokenizer.vocab_file (vocab.json / encoder.json)')
  _require_file(merge_file, 'data.tokenizer.merge_file (merges.txt / vocab.bpe)')
  tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  if tok.token_to_id(GPT2_EOT) is not None:
    tok.add_special_tokens([GPT2_EOT])
  out = HuggingFaceTokenizer(tok=tok, special={'bos_token': GPT2_EOT, 'eos_token': GPT2_EOT})
  out.path = vocab_file
  return out


def load_tokenizer(cfg):
  """From `config.data.tokenizer`, or a dict of its keys (type, model, vocab_file, merge_file)."""
  kind = _field(cfg, 'type')
  if kind == 'sentencepiece':
    return SentencePieceTokenizer(_field(cfg, 'model'))
  if kind == 'huggingface':
    return HuggingFaceTokenizer(_field(cfg, 'model'))
  if kind == 'gpt2':
    return gpt2_bpe(_field(cfg, 'vocab_file'), _field(cfg, 'merge_file'))
  raise DataError(f'data.tokenizer.type {kind!r}: choose sentencepiece (with .model), '
                   'huggingface (with .model = tokenizer.json) or gpt2 (with .vocab_file and '
                   '.merge_file)')


def check_vocab(tokenizer, model_cfg):
  """The model's embedding must have a row for every token id the tokenizer can emit."""
  if model_cfg.vocab_size < tokenizer.vocab_size:
    raise DataError(
        f'model.vocab_size = {model_cfg.vocab_size} is smaller than the tokenizer\'s '
        f'{tokenizer.vocab_size} tokens ({getattr(tokenizer, "path", "")}); set '
        f'--config.model.vocab_size={tokenizer.vocab_size}')


def train_sentencepiece(files, out_prefix: str, vocab_size: int, **overrides) -> str:
  """Trains a Llama-style SentencePiece BPE on text files; returns the .model path.

  Llama's settings: byte fallback (no unknown tokens), digits split one by one, text kept
  as is (identity normalization, whitespace preserved), <unk>=0 <s>=1 </s>=2, no pad.
  """
  import sentencepiece as spm
  os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
  options = dict(
      input=','.join(files), model_prefix=out_prefix, vocab_size=vocab_size, model_type='bpe',
      byte_fallback=True, split_digits=True, normalization_rule_name='identity',
      remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
      character_coverage=0.99995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      max_sentence_length=1 << 16, num_threads=os.cpu_count() or 1, minloglevel=2)
  options.update(overrides)
  spm.SentencePieceTrainer.train(**options)
  return out_prefix + '.model'
