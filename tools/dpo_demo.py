"""Get the DPO demo ready, and report it: preference pairs from the `make sft` conversations.

  python -m tools.dpo_demo [--data-dir .data]      # prepare; stdout: the train.py flags
  python -m tools.dpo_demo --report runs/dpo        # held-out reward accuracy and margin, before and after

No preference dataset installs from the package registry, so the pairs are derived, honestly
and reproducibly, from real conversations (tools/sft_demo.py's chitchat records): for every
assistant turn, the prompt is the conversation up to it, `chosen` is the reply the person
really gave, and `rejected` is an assistant reply taken from another conversation (chosen by
a hash of the pair's position), fluent but off-topic. A model that learns the preference
learns to stay on the conversation's topic. Held-out pairs come only from the held-out
conversations, their rejected replies too.
"""
import hashlib
import json
import os

from absl import app, flags

from tools import demo, sft_demo

MAX_PAIRS_PER_CONVERSATION = 2
log = demo.logger('dpo_demo')


def _pick(key, n) -> int:
  return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def pairs(conversations, max_per_conversation=MAX_PAIRS_PER_CONVERSATION) -> list:
  """Preference records (trl's conversational form) from chat records (lists of messages)."""
  replies = [(c, m['content']) for c, messages in enumerate(conversations)
             for m in messages if m['role'] == 'assistant']
  out = []
  for c, messages in enumerate(conversations):
    turns = [i for i, m in enumerate(messages) if m['role'] == 'assistant'][:max_per_conversation]
    for i in turns:
      for attempt in range(8):                     # another conversation's reply, not this one's
        other, text = replies[_pick(f'{c}/{i}/{attempt}', len(replies))]
        if other != c and text != messages[i]['content']:
          break
      out.append({'prompt': messages[:i], 'chosen': [messages[i]],
                  'rejected': [{'role': 'assistant', 'content': text}]})
  return out


def write_pairs(chat_dir):
  """pairs_train.jsonl / pairs_val.jsonl beside the chat records, one split from the other."""
  out = {}
  for split in ('train', 'val'):
    path = os.path.join(chat_dir, f'pairs_{split}.jsonl')
    if not os.path.exists(path):
      with open(os.path.join(chat_dir, f'{split}.jsonl')) as f:
        conversations = [json.loads(line)['messages'] for line in f]
      records = pairs(conversations)
      with open(path + '.partial', 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
      os.replace(path + '.partial', path)
      log(f'{len(records):,} {split} pairs from {len(conversations):,} conversations -> {path}')
    out[split] = path
  return out['train'], out['val']


def prepare(data_dir) -> list:
  train_flags = sft_demo.prepare(data_dir)
  train_path, val_path = write_pairs(os.path.join(data_dir, 'chitchat'))
  keep = [f for f in train_flags if not f.startswith(('--config.data.train_dir', '--config.data.val_dir'))]
  return keep + [f'--config.data.train_dir={train_path}', f'--config.data.val_dir={val_path}']


def report(workdir) -> str:
  """Held-out reward accuracy and margin before (the sanity validation) and after training."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  before = next((r for r in records if 'sanity_val_loss' in r), None)
  after = [r for r in records if 'val_loss' in r]
  if before is None or not after:
    raise SystemExit(f'{workdir}/metrics.jsonl lacks the sanity or final validation; did training finish?')
  after = after[-1]
  lines = ['held-out pairs (unseen conversations):          before -> after']
  for key in ('loss', 'rewards/accuracies', 'rewards/margins', 'rewards/chosen', 'rewards/rejected'):
    b = before['sanity_val_loss'] if key == 'loss' else before[f'sanity_val_{key}']
    a = after['val_loss'] if key == 'loss' else after[f'val_{key}']
    lines.append(f'  {key:<22} {b:>10.4f} -> {a:.4f}')
  steps = [r for r in records if 'rewards/accuracies' in r]
  lines.append('training pairs, by step: ' + ', '.join(
      f'{r["step"]}: acc {r["rewards/accuracies"]:.2f} margin {r["rewards/margins"]:.3f}' for r in steps))
  return '\n'.join(lines)


def define_flags():
  demo.define_flags()
  flags.adopt_module_key_flags(demo)      # --help lists them as this tool's


def main(argv):
  demo.main(argv, prepare, lambda workdir, data_dir: report(workdir))


if __name__ == '__main__':
  define_flags()
  app.run(main)
