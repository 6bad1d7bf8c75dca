"""tools/preprocess.py: JSONL and plain text to .bin/.idx, parallel = serial, clear errors."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from data import indexed, tokenizer
from data.errors import DataError
from tests import procs
from tools import preprocess

TEXTS = ['O Romeo, Romeo! wherefore art thou Romeo?', 'Deny thy father and refuse thy name;',
         'Or, if thou wilt not, be but sworn my love,\n\nAnd I\'ll no longer be a Capulet.',
         '', 'Tis but thy name that is my enemy; 1595']


@pytest.fixture(scope='module')
def sp_model(tmp_path_factory):
  root = tmp_path_factory.mktemp('sp')
  (root / 'train.txt').write_text('\n'.join(TEXTS * 20))
  return tokenizer.train_sentencepiece([str(root / 'train.txt')], str(root / 'sp'), 300)


@pytest.fixture
def jsonl(tmp_path):
  path = tmp_path / 'docs.jsonl'
  path.write_text(''.join(json.dumps({'id': i, 'content': t}) + '\n' for i, t in enumerate(TEXTS)))
  return str(path)


def cli(sp_model, *args):
  """`python -m tools.preprocess` with the test tokenizer and ARGS."""
  return procs.run([sys.executable, '-m', 'tools.preprocess', '--tokenizer-type=sentencepiece',
                    f'--tokenizer-model={sp_model}', '--quiet', *args], timeout=120)


def sp(model):
  return {'type': 'sentencepiece', 'model': model}


def test_jsonl_to_indexed_dataset(sp_model, jsonl, tmp_path):
  out = str(tmp_path / 'out')
  done = cli(sp_model, f'--input={jsonl}', '--json-key', 'content', f'--output-prefix={out}', '--workers=1')
  assert done.returncode == 0, done.stderr
  tok = tokenizer.load_tokenizer(sp(sp_model))
  ds = indexed.IndexedDataset(out)
  assert len(ds) == ds.num_documents == len(TEXTS) and ds.dtype == np.uint16
  for i, text in enumerate(TEXTS):
    assert ds[i].tolist() == tok.encode(text) + [tok.eod_id]
  assert f'{len(TEXTS)} documents' in done.stdout and 'docs/s' in done.stdout and 'tokens/s' in done.stdout


def test_parallel_workers_write_identical_files(sp_model, tmp_path):
  path = tmp_path / 'many.jsonl'
  g = np.random.default_rng(0)
  path.write_text(''.join(json.dumps({'text': ' '.join(g.choice(TEXTS, 3))}) + '\n'
                          for _ in range(300)))
  serial, parallel = str(tmp_path / 'serial'), str(tmp_path / 'parallel')
  for prefix, workers in ((serial, 1), (parallel, 2)):
    preprocess.preprocess([str(path)], prefix, sp(sp_model), workers=workers, quiet=True)
  for ext in ('.bin', '.idx'):
    assert Path(serial + ext).read_bytes() == Path(parallel + ext).read_bytes()


def test_plain_text_documents(sp_model, tmp_path):
  for i, t in enumerate(TEXTS[:3]):
    (tmp_path / f'{i}.txt').write_text(t)
  s = preprocess.preprocess([str(tmp_path / '*.txt')], str(tmp_path / 'files'),
                            {'type': 'sentencepiece', 'model': sp_model}, quiet=True)
  assert s['documents'] == 3 and s['files'] == 3
  s = preprocess.preprocess([str(tmp_path / '2.txt')], str(tmp_path / 'paras'),
                            {'type': 'sentencepiece', 'model': sp_model}, text_docs='paragraph',
                            quiet=True)
  assert s['documents'] == 2


def test_progress_line_reports_rates(sp_model, jsonl, tmp_path, capsys):
  preprocess.preprocess([jsonl], str(tmp_path / 'p'), {'type': 'sentencepiece', 'model': sp_model},
                        json_key='content')
  err = capsys.readouterr().err
  assert f'{len(TEXTS)} docs (' in err and 'docs/s' in err and 'tokens/s' in err


def test_bad_input_on_the_command_line_is_one_line(sp_model, tmp_path):
  """Exit status 2 and one `error: ...` line naming the file and line (no traceback), nothing written."""
  path = tmp_path / 'bad.jsonl'
  path.write_text('{"text": "fine"}\n{"text": oops}\n')
  done = cli(sp_model, f'--input={path}', f'--output-prefix={tmp_path / "o"}', '--workers=1')
  assert done.returncode == 2 and done.stderr.startswith('error: ') and done.stderr.count('\n') == 1, done.stderr
  assert 'bad.jsonl line 2: not valid JSON' in done.stderr
  assert not indexed.exists(str(tmp_path / 'o'))
  good = tmp_path / 'good.jsonl'
  good.write_text('{"text": "fine"}\n')
  done = cli(sp_model, '--input', str(good), str(path), f'--output-prefix={tmp_path / "o"}')   # as a shell's glob
  assert done.returncode == 2 and 'bad.jsonl line 2' in done.stderr, done.stderr


def test_missing_input_is_named(sp_model, tmp_path):
  with pytest.raises(FileNotFoundError, match='absent.jsonl'):
    preprocess.preprocess([str(tmp_path / 'absent.jsonl')], str(tmp_path / 'o'), sp(sp_model), quiet=True)


def test_missing_json_key_is_named(sp_model, jsonl, tmp_path):
  with pytest.raises(DataError, match="docs.jsonl line 1: no 'text' field; set --json-key"):
    preprocess.preprocess([jsonl], str(tmp_path / 'o'), sp(sp_model), quiet=True)


@pytest.mark.parametrize('name,text,text_docs', [
    ('empty.jsonl', '', 'file'), ('blank.jsonl', '\n  \n\n', 'file'),
    ('blank.txt', '\n\n \n', 'line'), ('blank.txt', '\n\n \n', 'paragraph'),
    ('blank.txt', '\n\n \n', 'file')])
def test_no_documents_is_an_error_naming_the_inputs(sp_model, tmp_path, name, text, text_docs):
  (tmp_path / name).write_text(text)
  (tmp_path / 'also_blank.txt').write_text('\n')
  out = str(tmp_path / 'out')
  with pytest.raises(DataError) as e:
    preprocess.preprocess([str(tmp_path / name), str(tmp_path / 'also_blank.txt')], out, sp(sp_model),
                          text_docs=text_docs, quiet=True)
  assert f'no documents in {tmp_path / name}, {tmp_path / "also_blank.txt"}' in str(e.value)
  assert not Path(out + '.bin').exists() and not Path(out + '.idx').exists()


def test_demo_unigram_entropy_from_token_counts(tmp_path):
  from tools import prepare_demo
  prefix = str(tmp_path / 'u')
  indexed.write(prefix, [[1, 1], [2, 3]] * 50 + [[7, 7, 7, 7]] * 2, np.uint16)
  # 100 train documents (1, 1, 2, 3 repeated), then valid and test hold one [7, 7, 7, 7] each.
  h = prepare_demo.unigram_entropy(prefix, '100,1,1')
  assert h == pytest.approx(-(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25)))
  assert prepare_demo.unigram_entropy(prefix, '100,1,1', 'valid') == 0.0


def test_demo_documents_are_whole_paragraphs():
  from tools import prepare_demo
  paragraphs = [f'Paragraph {i}. ' + 'x' * 90 for i in range(50)]
  docs = prepare_demo.paragraph_documents('\n\n'.join(paragraphs), min_chars=1000)
  assert '\n\n'.join(docs) == '\n\n'.join(paragraphs)
  assert all(len(d) >= 1000 for d in docs[:-1]) and len(docs) == 5
