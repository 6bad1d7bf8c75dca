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
import shutil

from data.errors import DataError
from user_errors import readable

TYPES = ('none', 'sentencepiece', 'huggingface', 'gpt2')     # data.tokenizer.type; none: no tokenizer
GPT2_EOT = '<|endoftext|>'
# Special-token spellings of the common families, tried when tokenizer_config.json is absent.
BOS_NAMES = ('<s>', '<|begin_of_text|>', '<bos>', '[BOS]', GPT2_EOT)
EOS_NAMES = ('</s>', '<|end_of_text|>', '<eos>', '[EOS]', GPT2_EOT)
PAD_NAMES = ('<pad>', '<|pad|>', '[PAD]', '<|finetune_right_pad_id|>')
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token',
                       'cls_token', 'mask_token')


def _field(cfg, name):
  return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def _require_file(path, what):
  if not path:
    raise DataError(f'tokenizer: {what} is not set; set it to the tokenizer file')
  if os.path.isdir(path):
    raise DataError(f'tokenizer: {what} {path!r} is a directory; point it at the file')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'tokenizer: {what} {path!r} does not exist')
  return readable(path)


class SentencePieceTokenizer:

  def __init__(self, model_file):
    import sentencepiece as spm
    self.path = _require_file(model_file, 'data.tokenizer.model (a SentencePiece .model)')
    try:
      self.sp = spm.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as e:
      raise DataError(f'tokenizer: {model_file}: not a SentencePiece model ({str(e).splitlines()[0][:160]}); it may '
                      'be cut short: copy it again, or point data.tokenizer.model at the .model file') from None
    self.vocab_size = self.sp.get_piece_size()
    self.bos_id, self.eos_id, self.pad_id = (
        i if i >= 0 else None for i in (self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()))
    self.eod_id = self.eos_id

  def encode(self, text: str) -> list:
    return self.sp.encode(text)

  def decode(self, ids) -> str:
    return self.sp.decode(list(map(int, ids)))


class HuggingFaceTokenizer:
  """A `tokenizers.Tokenizer`; special ids from the sibling tokenizer_config.json (or
  special_tokens_map.json) where present, as `special_tokens` reads them."""

  def __init__(self, tokenizer_json=None, tok=None, special=None):
    from tokenizers import Tokenizer
    if tok is None:
      self.path = _require_file(tokenizer_json, 'data.tokenizer.model (a tokenizer.json)')
      try:
        tok = Tokenizer.from_file(tokenizer_json)
      except Exception as e:  # pylint: disable=broad-except   (tokenizers raises a bare Exception)
        raise DataError(f'tokenizer: {tokenizer_json}: not a readable tokenizer.json ({str(e).splitlines()[0][:160]}); '
                        'it may be cut short: copy it again') from None
      special = special or special_tokens(os.path.dirname(tokenizer_json))
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


def read_config(directory, name='tokenizer_config.json') -> dict:
  """A tokenizer directory's JSON settings file (tokenizer_config.json, special_tokens_map.json)
  as a dict, {} when absent. Its special tokens and chat template are optional, so the fix
  offered for a broken file is to repair or delete it."""
  path = os.path.join(directory, name)
  if not os.path.exists(path):
    return {}
  _require_file(path, name)
  with open(path, encoding='utf-8') as f:
    try:
      config = json.load(f)
    except ValueError as e:       # not JSON, or not UTF-8
      raise DataError(f'{path}: not valid JSON ({e}); fix or delete it (the special tokens then come '
                      'from their usual names; a chat template may stand in chat_template.jinja)') from None
  if not isinstance(config, dict):
    raise DataError(f'{path}: expected a JSON object of tokenizer settings; fix or delete it')
  return config


def special_tokens(directory) -> dict:
  """{bos_token: '<s>', ...} from tokenizer_config.json (strings or {'content': ...} dicts),
  with special_tokens_map.json (older saves) filling the names the config lacks."""
  found = {}
  for name in ('tokenizer_config.json', 'special_tokens_map.json'):
    config = read_config(directory, name)
    for key in SPECIAL_TOKEN_NAMES:
      value = config.get(key)
      value = value.get('content') if isinstance(value, dict) else value
      if isinstance(value, str) and key not in found:
        found[key] = value
  return found


def gpt2_bpe(vocab_file, merge_file) -> HuggingFaceTokenizer:
  """GPT-2's byte-level BPE from its two files, built with the `tokenizers` library."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  _require_file(vocab_file, 'data.tokenizer.vocab_file (vocab.json / encoder.json)')
  _require_file(merge_file, 'data.tokenizer.merge_file (merges.txt / vocab.bpe)')
  with open(merge_file, 'rb') as f:   # an empty merges file would tokenize byte by byte, silently
    if not any(line.strip() and not line.startswith(b'#version') for line in f):
      raise DataError(f'tokenizer: {merge_file}: no merges in it (emptied or cut short?); copy it again')
  try:
    tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
  except Exception as e:  # pylint: disable=broad-except   (the tokenizers library's own error type)
    raise DataError(f'tokenizer: {vocab_file} and {merge_file} are not a readable GPT-2 vocabulary and merges '
                    f'({str(e).splitlines()[0][:160]}); they may be cut short: copy them again') from None
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


# The files a Hugging Face model directory holds for its tokenizer (AutoTokenizer reads them).
HF_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'tokenizer.model',
                      'vocab.json', 'merges.txt', 'added_tokens.json', 'chat_template.jinja', 'chat_template.json')


def hf_directory(cfg):
  """The directory whose tokenizer files `config.data.tokenizer` names (huggingface type), or None."""
  if _field(cfg, 'type') == 'huggingface' and _field(cfg, 'model'):
    return os.path.dirname(os.path.abspath(_field(cfg, 'model')))
  return None


def from_directory(directory):
  """The tokenizer of an HF model directory: tokenizer.json, else a SentencePiece tokenizer.model,
  else GPT-2's vocab.json + merges.txt."""
  path = lambda name: os.path.join(directory, name)
  if os.path.isfile(path('tokenizer.json')):
    return HuggingFaceTokenizer(path('tokenizer.json'))
  if os.path.isfile(path('tokenizer.model')):
    return SentencePieceTokenizer(path('tokenizer.model'))
  if os.path.isfile(path('vocab.json')) and os.path.isfile(path('merges.txt')):
    return gpt2_bpe(path('vocab.json'), path('merges.txt'))
  raise FileNotFoundError(f'{directory} holds no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + '
                          'merges.txt); pass --tokenizer=<HF directory>')


def copy_hf_files(source, directory) -> bool:
  """Copy the tokenizer files of HF directory `source` into `directory`; whether it had any."""
  names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))]
  os.makedirs(directory, exist_ok=True)
  for name in names:
    shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
  return bool(names)


def special_ids(tok) -> dict:
  """config.json's bos/eos/pad_token_id of tokenizer `tok` (None where it has no such token)."""
  return {'bos_token_id': tok.bos_id, 'eos_token_id': tok.eos_id, 'pad_token_id': tok.pad_id}


def write_hf_files(cfg, directory):
  """Write the tokenizer `config.data.tokenizer` names into `directory` as AutoTokenizer reads it
  (an HF tokenizer's own files; a SentencePiece model as tokenizer.model with Llama's
  tokenizer_config.json; GPT-2 BPE as a tokenizer.json). Returns the loaded tokenizer."""
  tok = load_tokenizer(cfg)
  os.makedirs(directory, exist_ok=True)
  if _field(cfg, 'type') == 'huggingface':
    source = hf_directory(cfg)
    copy_hf_files(source, directory)
    if os.path.basename(tok.path) != 'tokenizer.json':
      shutil.copyfile(tok.path, os.path.join(directory, 'tokenizer.json'))
    if os.path.isfile(os.path.join(source, 'tokenizer_config.json')):
      return tok
    config = {'tokenizer_class': 'PreTrainedTokenizerFast'}
  elif _field(cfg, 'type') == 'sentencepiece':
    shutil.copyfile(tok.path, os.path.join(directory, 'tokenizer.model'))
    config = {'tokenizer_class': 'LlamaTokenizer', 'add_bos_token': tok.bos_id is not None, 'add_eos_token': False,
              'legacy': False, 'unk_token': tok.sp.id_to_piece(tok.sp.unk_id())}
  else:                                      # gpt2: the tokenizer built from its two files
    tok.tok.save(os.path.join(directory, 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast'}
  piece = (lambda i: tok.sp.id_to_piece(i)) if hasattr(tok, 'sp') else tok.tok.id_to_token
  for key, i in (('bos_token', tok.bos_id), ('eos_token', tok.eos_id), ('pad_token', tok.pad_id)):
    if i is not None:
      config[key] = piece(i)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  return tok


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
