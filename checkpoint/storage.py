"""Paths of checkpoint storage: local directories, `s3://bucket/prefix`, `gs://bucket/prefix`.

Everything a checkpoint touches goes through tensorstore key-value stores, so the same code
writes to a local (or shared network) filesystem and to object stores. Object stores have no
rename and no directories, which is why the commit protocol (manager.py) is a marker object
written last, never a rename.

S3: credentials come from the usual AWS chain (env vars, ~/.aws, instance role). tensorstore
does not read AWS_ENDPOINT_URL itself, so an endpoint given there (or in
AWS_ENDPOINT_URL_S3) is passed in the spec: S3-compatible servers (MinIO, moto) work that way.
"""
import os
import shutil

import tensorstore as ts


def is_remote(path: str) -> bool:
  return path.startswith(('s3://', 'gs://'))


def join(path: str, *parts: str) -> str:
  for part in parts:
    if part:
      path = path.rstrip('/') + '/' + part.strip('/')
  return path


def kvstore_spec(path: str) -> dict:
  """tensorstore kvstore spec of the directory `path` (the spec's path ends in '/')."""
  for scheme, driver in (('s3://', 's3'), ('gs://', 'gcs')):
    if path.startswith(scheme):
      bucket, _, prefix = path[len(scheme):].partition('/')
      if not bucket:
        raise ValueError(f'{path!r}: expected {scheme}BUCKET/PREFIX')
      spec = {'driver': driver, 'bucket': bucket, 'path': prefix.strip('/') + '/' if prefix.strip('/') else ''}
      endpoint = os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL')
      if driver == 's3' and endpoint:
        spec['endpoint'] = endpoint
      return spec
  if path.startswith('file://'):
    path = path[len('file://'):]
  return {'driver': 'file', 'path': os.path.abspath(path) + '/'}


def _open(path, context=None):
  return ts.KvStore.open(kvstore_spec(path), context=context or ts.Context()).result()


def list_dir(path: str) -> list:
  """Names of the entries directly under `path` (files and directories / key prefixes)."""
  if not is_remote(path):
    local = kvstore_spec(path)['path']
    return sorted(os.listdir(local)) if os.path.isdir(local) else []
  # Object stores list every key below the prefix; with OCDBT that is a few objects per rank
  # and step, so this stays small.
  keys = _open(path).list().result()
  return sorted({k.decode().split('/', 1)[0] for k in keys})


def exists(path: str, key: str) -> bool:
  if not is_remote(path):
    return os.path.exists(os.path.join(kvstore_spec(path)['path'], key))
  return _open(path).read(key.encode()).result().state == 'value'


def _successor(prefix: str) -> bytes:
  """Smallest key greater than every key with this prefix (prefix has no 0xff bytes)."""
  raw = prefix.encode()
  return raw[:-1] + bytes([raw[-1] + 1])


def read_text(path: str, key: str):
  """Contents of object `key` under `path`, or None when it does not exist."""
  result = _open(path).read(key.encode()).result()
  return result.value.decode() if result.state == 'value' else None


def write_text(path: str, key: str, text: str):
  """Write (atomically: the file driver writes a temporary and renames it; objects are
  replaced whole) and durably (the file driver fsyncs) before returning."""
  _open(path).write(key.encode(), text.encode()).result()


def delete(path: str, key: str):
  """Delete the object `key` (and nothing else: the range is [key, key + NUL))."""
  _open(path).delete_range(ts.KvStore.KeyRange(key.encode(), key.encode() + b'\0')).result()


def delete_tree(path: str, prefix: str = ''):
  """Delete every object under `path`/`prefix`; local directories are removed too."""
  if not is_remote(path):
    shutil.rmtree(os.path.join(kvstore_spec(path)['path'], prefix), ignore_errors=True)
    return
  store = _open(path)
  key_range = ts.KvStore.KeyRange(prefix.encode(), _successor(prefix)) if prefix else ts.KvStore.KeyRange()
  store.delete_range(key_range).result()
