"""On-disk cache of sample-index arrays, named by a hash of everything they depend on.

Files go to `index_mapping_dir` or `<data dir>/index_cache/`:
  <name>-<split>-<hash>.json                     what the hash covers (for humans)
  <name>-<split>-<hash>-e<epoch>-<array>.npy     one array of one epoch, memory-mapped on load
Changing the data (its sequence sizes), the split, seq_length or the seed changes the hash,
so stale arrays are never read: new ones are built beside them. Writes go to a temporary
file renamed into place, so ranks that build the same array at once cannot read a torn file.
"""
import hashlib
import json
import os
import warnings

import numpy as np

FORMAT = 1   # bump when the index layout changes: old caches then miss and are rebuilt


def digest(*parts) -> str:
  """Short hex hash of the parts; numpy arrays contribute their bytes."""
  h = hashlib.blake2b(digest_size=8)
  for p in parts:
    if isinstance(p, np.ndarray):
      h.update(np.ascontiguousarray(p).view(np.uint8).data)
    else:
      h.update(repr(p).encode())
    h.update(b'|')
  return h.hexdigest()


class IndexCache:

  def __init__(self, directory: str, stem: str, description: dict):
    self.directory = directory
    self.stem = stem
    self.description = description
    self.writable = True

  def path(self, epoch: int, name: str) -> str:
    return os.path.join(self.directory, f'{self.stem}-e{epoch:04d}-{name}.npy')

  def load(self, epoch: int, names) -> dict:
    """The epoch's arrays if all are on disk and readable, else None."""
    out = {}
    for name in names:
      try:
        out[name] = np.load(self.path(epoch, name), mmap_mode='r')
      except (OSError, ValueError):
        return None
    return out

  def save(self, epoch: int, arrays: dict):
    if not self.writable:
      return
    try:
      os.makedirs(self.directory, exist_ok=True)
      self._write_description()
      for name, arr in arrays.items():
        _atomic_save(self.path(epoch, name), arr)
    except OSError as e:
      self.writable = False
      warnings.warn(f'cannot cache sample indices in {self.directory} ({e}); building them in '
                    'memory each run. Set data.index_mapping_dir to a writable folder.')

  def _write_description(self):
    path = os.path.join(self.directory, self.stem + '.json')
    if not os.path.exists(path):
      tmp = f'{path}.tmp{os.getpid()}'
      with open(tmp, 'w') as f:
        json.dump(self.description, f, indent=1, sort_keys=True)
      os.replace(tmp, path)


def _atomic_save(path: str, arr: np.ndarray):
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    np.save(f, arr)
  os.replace(tmp, path)
