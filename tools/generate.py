"""Generate text from a flatron checkpoint step or a Hugging Face directory.

    python -m tools.generate --model=.data/models/smollm2-135m-instruct --chat="What is the capital of France?"
    python -m tools.generate --model=runs/sft/checkpoints/step_00000100 \
        --tokenizer=.data/models/smollm2-135m-instruct --chat=... --temperature=0.7 --top_p=0.9
    python -m tools.generate --model=runs/tiny/checkpoints --prompt="ROMEO:"    # the newest step

A flatron step carries its config (metadata.json): the model is rebuilt from it and its
tokenizer (data.tokenizer) is used unless --tokenizer names an HF directory. `--chat` wraps
the text as a user message (`--messages` takes a JSON list of {role, content}) and applies
the tokenizer's chat template with the generation prompt. Greedy unless --temperature > 0.
"""
import json
import os

from absl import app, flags

import tools
import user_errors
from checkpoint import state as states, steps as checkpoint_steps
from configs import base
from data import chat, tokenizer as tokenizers
from model import adapters, generation, hf

FLAGS = flags.FLAGS


def load_model(path):
  """(model section, params, tokenizer config or None) from a flatron step or an HF directory;
  LoRA adapters stay separate (generation applies them), a peft directory is not a model."""
  path = states.resolve_step(path)
  if checkpoint_steps.is_committed(path):
    config, params = states.read_model(path)
    return config.model, params, config.data.tokenizer
  model_cfg, params = hf.load_hf(path, base.get_config().model)
  return model_cfg, params, None


def load_tokenizer(tokenizer_dir, tokenizer_cfg):
  if tokenizer_dir:
    return tokenizers.from_directory(tokenizer_dir)
  if tokenizer_cfg is None or tokenizer_cfg.type == 'none':
    raise SystemExit('error: this model names no tokenizer; pass --tokenizer=<HF directory>')
  return tokenizers.load_tokenizer(tokenizer_cfg)


def prompt_ids(tok, tokenizer_dir, prompt=None, messages=None):
  """Token ids of a plain prompt, or of chat messages through the chat template (with the
  generation prompt), and the ids that end a reply."""
  stop = {i for i in (tok.eos_id,) if i is not None}
  if prompt is not None:
    return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt), stop
  directory = tokenizer_dir or os.path.dirname(os.path.abspath(tok.path))
  template = chat.load_template(directory)
  if template is None:
    raise SystemExit(f'error: {directory} has no chat template; use --prompt')
  text = chat.render(template, messages, add_generation_prompt=True, **chat.special_tokens(directory))
  return tok.encode(text), stop


def reply(model, prompt=None, messages=None, tokenizer_dir=None, max_new_tokens=64,
          sampling=generation.Sampling()):
  """The text `model` (a path, or the (model section, params, tokenizer config) of load_model)
  generates after a prompt or chat messages."""
  model_cfg, params, tokenizer_cfg = load_model(model) if isinstance(model, str) else model
  tokenizer_dir = tokenizer_dir or (states.resolve_step(model) if isinstance(model, str) and tokenizer_cfg is None else None)
  tok = load_tokenizer(tokenizer_dir, tokenizer_cfg)
  ids, stop = prompt_ids(tok, tokenizer_dir, prompt, messages)
  out = generation.generate(params, model_cfg, ids, max_new_tokens, sampling, stop_ids=stop)
  return tok.decode([t for t in out if t not in stop])


def define_flags():
  flags.DEFINE_string('model', None, 'A flatron checkpoint step, a checkpoint directory (its newest '
                      'committed step is used) or an HF model directory.')
  flags.mark_flag_as_required('model')
  flags.DEFINE_string('adapter', None, 'A peft LoRA directory to apply to the model (e.g. from '
                      'python -m tools.convert export-peft, or trained with peft).')
  flags.DEFINE_string('tokenizer', None, 'An HF directory with tokenizer.json (default: the model\'s).')
  flags.DEFINE_string('prompt', None, 'Plain text to continue.')
  flags.DEFINE_string('chat', None, 'A user message, sent through the chat template.')
  flags.DEFINE_string('messages', None, 'A JSON list of {"role", "content"} messages.')
  flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate at most.')
  flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens (0 = all).')
  flags.DEFINE_float('top_p', 1.0, 'Sample among the most likely tokens reaching p.')
  flags.DEFINE_integer('seed', 0, 'Keys the sampling.')


def main(argv):
  """Errors a user can fix end in one line, exit 2 (user_errors.py)."""
  user_errors.exit_on_error(_main, argv, also=(ValueError,))


def _main(argv):
  tools.no_arguments(argv)
  if sum(x is not None for x in (FLAGS.prompt, FLAGS.chat, FLAGS.messages)) != 1:
    raise app.UsageError('give exactly one of --prompt, --chat, --messages')
  try:
    messages = json.loads(FLAGS.messages) if FLAGS.messages else [{'role': 'user', 'content': FLAGS.chat}]
  except json.JSONDecodeError as e:
    tools.fail(f'--messages: not valid JSON at column {e.colno}: {e.msg} (a list of {{"role", "content"}} objects)')
  sampling = generation.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed)
  model = load_model(FLAGS.model)
  tokenizer_dir = FLAGS.tokenizer or (states.resolve_step(FLAGS.model) if model[2] is None else None)
  if FLAGS.adapter:
    model = adapters.load_peft(FLAGS.adapter, model[0], model[1]) + (model[2],)
  text = reply(model, FLAGS.prompt, messages, tokenizer_dir, FLAGS.max_new_tokens, sampling)
  print(FLAGS.prompt + text if FLAGS.prompt is not None else text)    # a prompt is continued


if __name__ == '__main__':
  define_flags()
  app.run(main)
