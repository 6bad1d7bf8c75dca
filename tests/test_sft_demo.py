"""tools/sft_demo.py: chitchat conversations become chat records with a fixed held-out split."""
import json

from data import sft
from tools import sft_demo


def _conversation(*turns):
  return {'messages': [[{'text': text, 'sender': f's{i % 2}'} for text in turn] for i, turn in enumerate(turns)]}


def test_turns_alternate_user_assistant_and_end_on_the_assistant():
  conv = _conversation(['Hello', 'how are you?'], ['fine '], ['and', ' you'], [' ', ''], ['great'])
  messages = sft_demo.to_messages(conv)
  assert messages == [{'role': 'user', 'content': 'Hello how are you?'}, {'role': 'assistant', 'content': 'fine'},
                      {'role': 'user', 'content': 'and you'}, {'role': 'assistant', 'content': 'great'}]
  long = _conversation(*[[f't{i}'] for i in range(11)])
  assert len(sft_demo.to_messages(long)) == sft_demo.MAX_TURNS
  assert sft_demo.to_messages(_conversation(['only one turn'])) == []


def test_records_split_is_fixed_and_readable_as_sft_records(tmp_path):
  data = {f'id{i}': _conversation([f'q{i}'], [f'a{i}']) for i in range(100)}
  data['single'] = _conversation(['alone'])
  (tmp_path / 'dataset.json').write_text(json.dumps(data))
  train_path, val_path = sft_demo.write_records(str(tmp_path / 'dataset.json'), str(tmp_path / 'out'))
  train, val = sft.read_records(train_path), sft.read_records(val_path)
  assert len(val) == sft_demo.VAL_CONVERSATIONS and len(train) + len(val) == 100
  seen = {r.fields['messages'][0]['content'] for r in train} | {r.fields['messages'][0]['content'] for r in val}
  assert len(seen) == 100                                      # every conversation once
  again = sft_demo.write_records(str(tmp_path / 'dataset.json'), str(tmp_path / 'again'))
  assert open(again[1]).read() == open(val_path).read()        # the same held-out set
  assert sft_demo.held_out_openings(val_path, 2) == [r.fields['messages'][0]['content'] for r in val[:2]]
