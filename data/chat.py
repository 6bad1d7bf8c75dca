"""Chat templates, rendered as transformers' `apply_chat_template` renders them, and the
assistant mask of a tokenized conversation.

A chat template is the Jinja source a model ships in tokenizer_config.json (`chat_template`)
or beside it (`chat_template.jinja`). It is rendered in a sandbox with the same settings,
filters and globals transformers gives it (`tojson`, `raise_exception`, `strftime_now`,
`namespace`, `dict`, a pass-through `{% generation %}` tag), with `messages`, `tools`,
`documents`, `add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...).
The text is then tokenized without adding special tokens, as transformers does for chat.

The assistant mask marks the tokens of each assistant turn's content and its end-of-turn
token(s). A turn's text is what rendering messages[:i + 1] adds to rendering messages[:i]
with the generation prompt, less the whitespace after the end of the turn (ChatML's "\n"
after <|im_end|>: the model never generates it, the next header follows it).
"""
import functools
import json
import os
from datetime import datetime

import numpy as np

from data import tokenizer as tokenizers
from data.errors import DataError

# Names a message's reasoning comes under; templates read `reasoning_content` (or `thinking`).
REASONING_FIELDS = ('reasoning_content', 'thinking', 'reasoning')


def load_template(tokenizer_dir):
  """The default chat template of a tokenizer directory, or None when it has none.

  As transformers: chat_template.jinja wins over tokenizer_config.json's `chat_template`,
  which is a string or a list of {name, template} (the one named 'default' is used).
  """
  jinja_file = os.path.join(tokenizer_dir, 'chat_template.jinja')
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding='utf-8') as f:
      return f.read()
  config_file = os.path.join(tokenizer_dir, 'tokenizer_config.json')
  template = tokenizers.read_config(tokenizer_dir).get('chat_template')
  if template is None or isinstance(template, str):
    return template
  if isinstance(template, list):
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    if isinstance(named.get('default'), str):
      return named['default']
  raise DataError(f'{config_file}: chat_template is neither a string nor a list of '
                  '{"name", "template"} with one named "default"; fix it, or put the template '
                  'in chat_template.jinja beside it')


# The {bos_token: ..., ...} a template renders with; tokenizer.py reads them for its ids too.
special_tokens = tokenizers.special_tokens


@functools.lru_cache(maxsize=16)
def compile_template(template: str):
  """The jinja2 Template, in the environment transformers builds (cached: templates are long)."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_generation_tag(), jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  env.globals['dict'] = _TemplateDict()
  env.globals['namespace'] = _namespace_class()
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise DataError(f'chat template line {e.lineno}: {e.message}; fix the template') from None


def render(template: str, messages, add_generation_prompt=False, tools=None, documents=None,
           **special) -> str:
  """The template's text for `messages` (list of {role, content, ...}), as apply_chat_template."""
  # transformers drops None values (content=None from OpenAI-style APIs) and aliases reasoning.
  messages = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
  return compile_template(template).render(
      messages=messages, tools=tools, documents=documents,
      add_generation_prompt=add_generation_prompt, **special)


def encode_chat(tokenizer, template: str, messages, **special):
  """(ids int64 [n], assistant_mask int8 [n]) of the conversation rendered for training."""
  text = render(template, messages, **special)
  spans = assistant_spans(template, messages, text, **special)
  ids, offsets = _encode_offsets(tokenizer, text)
  return np.asarray(ids, np.int64), spans_to_token_mask(offsets, spans)


def assistant_spans(template, messages, text, **special) -> list:
  """[(start, end)] character spans of the assistant turns inside `text` (the full rendering)."""
  spans = []
  for i, message in enumerate(messages):
    if message.get('role') != 'assistant':
      continue
    if i == 0:
      raise DataError('the first message is an assistant turn: nothing prompts it; start the '
                      'conversation with a system or user message')
    prompt = render(template, messages[:i], add_generation_prompt=True, **special)
    turn = render(template, messages[:i + 1], **special)
    if not turn.startswith(prompt) or not text.startswith(turn):
      raise DataError(
          f'chat template: the rendering of messages[:{i}] with the generation prompt is not a '
          f'prefix of the rendering of messages[:{i + 1}] (or that is not a prefix of the whole '
          f'conversation), so assistant turn {i} cannot be located; this template rewrites '
          'earlier turns (e.g. drops past reasoning): pre-tokenize the data with input_ids and '
          'loss_mask instead')
    spans.append((len(prompt), len(turn.rstrip())))
  return spans


def spans_to_token_mask(offsets, spans) -> np.ndarray:
  """1 on each token whose characters overlap a span (a token straddling an edge counts)."""
  starts = np.array([a for a, _ in offsets], np.int64).reshape(-1)
  ends = np.array([b for _, b in offsets], np.int64).reshape(-1)
  mask = np.zeros(len(offsets), np.int8)
  for a, b in spans:
    if b > a:
      # An empty-range token (nothing of its own in the text) counts where it starts.
      mask |= (starts < b) & (np.maximum(ends, starts + 1) > a)
  return mask


def _encode_offsets(tokenizer, text):
  encode = getattr(tokenizer, 'encode_offsets', None)
  if encode is None:
    raise DataError('chat records need a Hugging Face tokenizer (data.tokenizer.type='
                    'huggingface with model = tokenizer.json) to map assistant turns to tokens; '
                    f'{type(tokenizer).__name__} cannot')
  return encode(text)


def _alias_reasoning(message):
  reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
  if reasoning is None:
    return message
  return {'thinking': reasoning, **message, 'reasoning_content': reasoning}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes HTML characters (<, >, &, '): templates expect plain JSON.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise_exception(message):
  import jinja2
  raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
  return datetime.now().strftime(fmt)


class _TemplateDict:
  """`dict(...)` in a template, without the class itself (no attribute walks out of it)."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def _namespace_class():
  import jinja2

  class TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore names (they reach CPython internals)."""

    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
      self, attrs = args[0], dict(*args[1:], **kwargs)
      for name in attrs:
        _check_attr(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      _check_attr(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

  return TemplateNamespace


def _check_attr(name):
  import jinja2
  if isinstance(name, str) and name.startswith('_'):
    raise jinja2.exceptions.SecurityError(
        f'chat templates cannot store underscore attributes on a namespace ({name!r})')


@functools.lru_cache(maxsize=1)
def _generation_tag():
  """`{% generation %}...{% endgeneration %}` renders its body (transformers marks assistant
  text with it; we find assistant turns by prefix rendering, so the tag only has to parse)."""
  import jinja2.ext
  import jinja2.nodes

  class GenerationTag(jinja2.ext.Extension):
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  return GenerationTag
