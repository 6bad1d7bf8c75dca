"""Generate text from a flatron checkpoint step or a Hugging Face directory.

    python tools/generate.py --model=.data/models/smollm2-135m-instruct --chat="What is the capital of France?"
    python tools/generate.py --model=runs/sft/checkpoints/step_00000100 \
        --tokenizer=.data/models/smollm2-135m-instruct --chat=... --temperature=0.7 --top_p=0.9
    python tools/generate.py --model=runs/tiny/checkpoints/step_00000600 --prompt="ROMEO:"

A flatron step carries its config (metadata.json): the model is rebuilt from it and its
tokenizer (data.tokenizer) is used unless --tokenizer names an HF directory. `--chat` wraps
the text as a user message (`--messages` takes a JSON list of {role, content}) and applies
the tokenizer's chat template with the generation prompt. Greedy unless --temperature > 0.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_dict  # pylint: disable=wrong-import-position
import torch  # pylint: disable=wrong-import-position

from checkpoint import manager as managers, store  # pylint: disable=wrong-import-position
from configs import base  # pylint: disable=wrong-import-position
from data import chat, tokenizer as tokenizers  # pylint: disable=wrong-import-position
from model import generation, hf, transformer  # pylint: disable=wrong-import-position

_MODEL = flags.DEFINE_string('model', None, 'A flatron checkpoint step directory or an HF model directory.')
_TOKENIZER = flags.DEFINE_string('tokenizer', None, 'An HF directory with tokenizer.json (default: the model\'s).')
_PROMPT = flags.DEFINE_string('prompt', None, 'Plain text to continue.')
_CHAT = flags.DEFINE_string('chat', None, 'A user message, sent through the chat template.')
_MESSAGES = flags.DEFINE_string('messages', None, 'A JSON list of {"role", "content"} messages.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate at most.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens (0 = all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sample among the most likely tokens reaching p.')
_SEED = flags.DEFINE_integer('seed', 0, 'Keys the sampling.')


def load_model(path):
  """(model section, params, tokenizer config or None) from a flatron step or an HF directory."""
  if managers.is_committed(path):
    meta = managers.read_metadata(path)
    config = config_dict.ConfigDict(meta['config'])
    model_cfg = config.model
    specs = transformer.param_specs(model_cfg)
    requests = {n: tuple(slice(0, d) for d in (model_cfg.vocab_size,) + spec.shape[1:])
                if n in ('embed_tokens.weight', 'lm_head.weight') else tuple(slice(0, d) for d in spec.shape)
                for n, spec in specs.items()}
    arrays = store.load_arrays(path, requests)
    params = {}
    for name, spec in specs.items():
      padded = torch.zeros(spec.shape)
      padded[:arrays[name].shape[0]] = arrays[name].float()
      params[name] = padded
    return model_cfg, params, config.data.tokenizer
  model_cfg, params = hf.load_hf(path, base.get_config().model)
  return model_cfg, params, None


def load_tokenizer(tokenizer_dir, tokenizer_cfg):
  if tokenizer_dir:
    return tokenizers.load_tokenizer({'type': 'huggingface', 'model': os.path.join(tokenizer_dir, 'tokenizer.json')})
  if tokenizer_cfg is None or tokenizer_cfg.type == 'none':
    raise SystemExit('error: this model names no tokenizer; pass --tokenizer=<HF directory>')
  return tokenizers.load_tokenizer(tokenizer_cfg)


def prompt_ids(tok, tokenizer_dir):
  """Token ids of the prompt, and the ids that end a reply."""
  stop = {i for i in (tok.eos_id,) if i is not None}
  if _PROMPT.value is not None:
    ids = tok.encode(_PROMPT.value)
    return ([tok.bos_id] if tok.bos_id is not None else []) + ids, stop
  messages = json.loads(_MESSAGES.value) if _MESSAGES.value else [{'role': 'user', 'content': _CHAT.value}]
  directory = tokenizer_dir or os.path.dirname(os.path.abspath(tok.path))
  template = chat.load_template(directory)
  if template is None:
    raise SystemExit(f'error: {directory} has no chat template; use --prompt')
  special = chat.special_tokens(directory)
  text = chat.render(template, messages, add_generation_prompt=True, **special)
  return tok.encode(text), stop


def main(argv):
  del argv
  if sum(x is not None for x in (_PROMPT.value, _CHAT.value, _MESSAGES.value)) != 1:
    raise app.UsageError('give exactly one of --prompt, --chat, --messages')
  model_cfg, params, tokenizer_cfg = load_model(_MODEL.value)
  tokenizer_dir = _TOKENIZER.value or (_MODEL.value if tokenizer_cfg is None else None)
  tok = load_tokenizer(tokenizer_dir, tokenizer_cfg)
  ids, stop = prompt_ids(tok, tokenizer_dir)
  sampling = generation.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _SEED.value)
  out = generation.generate(params, model_cfg, ids, _MAX_NEW.value, sampling, stop_ids=stop)
  print(tok.decode([t for t in out if t not in stop]))


if __name__ == '__main__':
  flags.mark_flag_as_required('model')
  app.run(main)
