"""Reading the files of a Hugging Face (or peft) directory with every failure one line that
names the file, where in it, and the fix: safetensors cut short or of another format, JSON that
does not parse (its line and column)."""
import contextlib
import json
import re

from safetensors import safe_open
from user_errors import UserError, readable


CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
SHARD_PATTERN = re.compile(r'model-\d{5}-of-\d{5}\.safetensors')
VOCAB_PARAMS = ('embed_tokens.weight', 'lm_head.weight')


class HFFileError(UserError, ValueError):
  """A Hugging Face file that cannot be read as it is: one line naming the file and the fix."""


@contextlib.contextmanager
def open_safetensors(file):
  """safe_open, any failure (a file cut short, another format) one line naming the file."""
  readable(file)
  try:
    handle = safe_open(file, framework='pt')
  except Exception as e:  # pylint: disable=broad-except   (safetensors' own error types)
    raise HFFileError(f'{file}: not a readable safetensors file ({str(e).splitlines()[0][:160]}); it may be cut '
                      'short: download or copy it again') from None
  with handle as f:
    yield f


def read_json(file, what='JSON'):
  """The JSON object in `file` (every HF settings file is one); a syntax error is one line with
  its line and column."""
  try:
    with open(file, encoding='utf-8') as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise HFFileError(f'{file}: not valid {what} at line {e.lineno} column {e.colno}: {e.msg}') from None
  except UnicodeDecodeError as e:
    raise HFFileError(f'{file}: not valid {what}: not UTF-8 text (byte {e.start})') from None
  if not isinstance(value, dict):
    raise HFFileError(f'{file}: expected a JSON object of settings, found {type(value).__name__}')
  return value
