"""model/hf_files.py: a safetensors file that cannot be opened, or JSON that does not parse,
is one HFFileError naming the file (and the JSON's line and column). The entry points' view of
the same damage: tests/test_user_errors.py."""
import pytest
import torch
from safetensors.torch import save_file

from model import hf_files


def test_json_errors_name_the_file_line_and_column(tmp_path):
  path = tmp_path / 'config.json'
  path.write_text('{\n  "a": 1,\n  "b": \n}')
  with pytest.raises(hf_files.HFFileError, match=r'config.json: not valid JSON at line 4 column 1: Expecting value'):
    hf_files.read_json(str(path))
  path.write_bytes(b'{"a": "\xff"}')
  with pytest.raises(hf_files.HFFileError, match=r'config.json: not valid JSON: not UTF-8 text \(byte 7\)'):
    hf_files.read_json(str(path))
  path.write_text('{"a": [1, 2]}')
  assert hf_files.read_json(str(path)) == {'a': [1, 2]}


def test_a_safetensors_file_cut_short_is_named(tmp_path):
  path = tmp_path / 'model.safetensors'
  save_file({'w': torch.arange(64.0)}, str(path))
  with hf_files.open_safetensors(str(path)) as f:
    assert torch.equal(f.get_tensor('w'), torch.arange(64.0))
  path.write_bytes(path.read_bytes()[:-8])
  with pytest.raises(hf_files.HFFileError, match=r'model.safetensors: not a readable safetensors file .*cut short'):
    with hf_files.open_safetensors(str(path)):
      pass
