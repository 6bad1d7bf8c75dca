"""Chat templates against transformers' apply_chat_template, token for token, and the
assistant mask. The tokenizer is a small byte-level BPE trained here, offline."""
import json
import os

import jinja2
import pytest

from data import chat, tokenizer
from data.errors import DataError

SENTENCES = [
    'The quick brown fox jumps over the lazy dog.', 'Hello! How are you today?',
    'I am fine, thank you. And you?', 'What is the capital of France? Paris is.',
    'Write a short poem about the sea and the sky.', 'You are a helpful assistant.',
    'Numbers like 12345 and 3.14 appear here, café déjà vu.',
]
SPECIALS = {'bos_token': '<|im_start|>', 'eos_token': '<|im_end|>',
            'unk_token': '<|endoftext|>', 'pad_token': '<|im_end|>'}

# SmolLM2-Instruct's ChatML template: a default system message when the chat has none.
SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Qwen2.5's shape: whitespace control, attribute access, the system message hoisted.
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The extras transformers provides: bos_token, namespace, tojson arguments, loop controls,
# strftime_now, raise_exception and the {% generation %} tag around assistant text.
EXTRAS = """{{ bos_token }}{{ strftime_now('%%') }}{% set ns = namespace(turns=0) %}
{% for message in messages %}
  {% if message.role not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role ' + message.role) }}
  {% endif %}
  {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}

  {% else %}
<|im_start|>{{ message.role }} {{ message.meta | tojson(indent=2, sort_keys=True) if message.meta else '' }}
{{ message.content }}<|im_end|>
  {% endif %}
  {% set ns.turns = ns.turns + 1 %}
  {% if ns.turns > 20 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CHATS = [
    [{'role': 'user', 'content': 'Hello! How are you today?'},
     {'role': 'assistant', 'content': 'I am fine, thank you.'}],
    [{'role': 'system', 'content': 'You are a helpful assistant.'},
     {'role': 'user', 'content': 'What is the capital of France?'},
     {'role': 'assistant', 'content': 'Paris.'},
     {'role': 'user', 'content': 'Write a short poem\nabout the sea.'},
     {'role': 'assistant', 'content': ' The sea, the sky,\n  café déjà vu. \n'}],
    [{'role': 'user', 'content': 'Numbers like 12345 and 3.14?', 'meta': {'b': '<&>', 'a': 1}}],
]


def train_bpe():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(SENTENCES * 4, trainer)
  return tok


def tokenizer_dir(path, template=SMOL, as_jinja_file=False) -> str:
  """A tokenizer directory as Hugging Face saves one: tokenizer.json, tokenizer_config.json."""
  os.makedirs(path, exist_ok=True)
  train_bpe().save(os.path.join(path, 'tokenizer.json'))
  config = {key: {'content': value, 'special': True} if key == 'eos_token' else value
            for key, value in SPECIALS.items()}
  if as_jinja_file:
    with open(os.path.join(path, 'chat_template.jinja'), 'w') as f:
      f.write(template)
    config['chat_template'] = 'not used: chat_template.jinja wins'
  else:
    config['chat_template'] = template
  with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
    json.dump(config, f)
  return str(path)


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
  return tokenizer_dir(tmp_path_factory.mktemp('tok'))


@pytest.fixture(scope='module')
def ours(tok_dir):
  return tokenizer.HuggingFaceTokenizer(os.path.join(tok_dir, 'tokenizer.json'))


def theirs(tok_dir, template):
  from tokenizers import Tokenizer
  from transformers import PreTrainedTokenizerFast
  return PreTrainedTokenizerFast(
      tokenizer_object=Tokenizer.from_file(os.path.join(tok_dir, 'tokenizer.json')),
      chat_template=template, **SPECIALS)


@pytest.mark.parametrize('template', [SMOL, QWEN, EXTRAS], ids=['smollm2', 'qwen', 'extras'])
@pytest.mark.parametrize('add_generation_prompt', [False, True])
def test_render_and_tokens_match_transformers(tok_dir, ours, template, add_generation_prompt):
  hf = theirs(tok_dir, template)
  for messages in CHATS:
    text = chat.render(template, messages, add_generation_prompt, **SPECIALS)
    assert text == hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(messages, tokenize=True,
                                      add_generation_prompt=add_generation_prompt)['input_ids']
    assert ours.encode(text) == expected
    if not add_generation_prompt and messages[-1]['role'] == 'assistant':
      ids, _ = chat.encode_chat(ours, template, messages, **SPECIALS)
      assert ids.tolist() == expected


def test_special_tokens_and_default_system_message_are_rendered():
  text = chat.render(SMOL, CHATS[0][:1], add_generation_prompt=True, **SPECIALS)
  assert text.startswith('<|im_start|>system\nYou are a helpful AI assistant named SmolLM')
  assert text.endswith('<|im_start|>user\nHello! How are you today?<|im_end|>\n'
                       '<|im_start|>assistant\n')
  assert chat.render(EXTRAS, CHATS[0], **SPECIALS).startswith('<|im_start|>%')  # bos_token


def test_assistant_mask_is_the_assistant_contents_and_im_end(ours):
  for template in (SMOL, QWEN, EXTRAS):
    for messages in CHATS[:2]:
      ids, mask = chat.encode_chat(ours, template, messages, **SPECIALS)
      runs = masked_runs(ids, mask)
      wanted = [m['content'] + '<|im_end|>' for m in messages if m['role'] == 'assistant']
      assert [ours.decode(r) for r in runs] == wanted
      # Nothing else: every <|im_end|> after a prompt turn and every header is unmasked.
      assert mask.sum() == sum(len(r) for r in runs)


def test_assistant_mask_agrees_with_transformers_generation_tag(tok_dir, ours):
  hf = theirs(tok_dir, EXTRAS)
  for messages in CHATS[:2]:
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    _, mask = chat.encode_chat(ours, EXTRAS, messages, **SPECIALS)
    assert mask.tolist() == out['assistant_masks']


def masked_runs(ids, mask):
  runs, current = [], []
  for i, m in zip(ids.tolist(), mask.tolist()):
    if m:
      current.append(i)
    elif current:
      runs, current = runs + [current], []
  return runs + ([current] if current else [])


def test_offsets_are_untrimmed_and_ids_unchanged(tok_dir):
  from tokenizers import processors
  tok = tokenizer.HuggingFaceTokenizer(os.path.join(tok_dir, 'tokenizer.json'))
  tok.tok.post_processor = processors.ByteLevel(trim_offsets=True)   # as GPT-2's tokenizer.json
  text = 'a \n b  '
  ids, offsets = tok.encode_offsets(text)
  assert ids == tok.encode(text)
  assert [text[a:b] for a, b in offsets] == [tok.decode([i]) for i in ids]


def test_tojson_keeps_html_characters_and_takes_arguments():
  out = chat.render("{{ messages[0] | tojson(indent=1, separators=(',', ': ')) }}",
                    [{'role': 'user', 'content': "<a & 'b'> é"}])
  assert out == '{\n "role": "user",\n "content": "<a & \'b\'> é"\n}'


def test_raise_exception_and_namespace_guard():
  with pytest.raises(jinja2.TemplateError, match='unknown role tool'):
    chat.render(EXTRAS, [{'role': 'tool', 'content': 'x'}])
  with pytest.raises(jinja2.exceptions.SecurityError):
    chat.render('{% set ns = namespace(_x=1) %}', [])


def test_none_values_are_dropped_like_transformers():
  template = "{% for m in messages %}{{ 'has' if 'content' in m else 'none' }}{% endfor %}"
  assert chat.render(template, [{'role': 'assistant', 'content': None}]) == 'none'


def test_load_template_and_special_tokens(tmp_path):
  plain = tokenizer_dir(tmp_path / 'plain', template=QWEN)
  assert chat.load_template(plain) == QWEN
  assert chat.special_tokens(plain) == SPECIALS                    # eos given as {'content': ...}
  assert chat.load_template(tokenizer_dir(tmp_path / 'file', QWEN, as_jinja_file=True)) == QWEN
  listed = tmp_path / 'listed'
  listed.mkdir()
  (listed / 'tokenizer_config.json').write_text(json.dumps({'chat_template': [
      {'name': 'tool_use', 'template': 'T'}, {'name': 'default', 'template': SMOL}]}))
  assert chat.load_template(listed) == SMOL
  assert chat.load_template(tmp_path) is None                      # no config at all
  (listed / 'tokenizer_config.json').write_text('{"chat_template": [1]}')
  with pytest.raises(DataError, match='tokenizer_config.json.*default'):
    chat.load_template(listed)


def test_conversations_that_cannot_be_masked_are_clear_errors(ours):
  with pytest.raises(DataError, match='first message is an assistant'):
    chat.encode_chat(ours, SMOL, [{'role': 'assistant', 'content': 'hi'}], **SPECIALS)
  # A template that drops earlier assistant turns: prefixes do not line up.
  last_only = "{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}"
  with pytest.raises(DataError, match='not a prefix'):
    chat.encode_chat(ours, last_only, CHATS[0], **SPECIALS)
  with pytest.raises(DataError, match='chat template line 1'):
    chat.compile_template('{% for %}')
