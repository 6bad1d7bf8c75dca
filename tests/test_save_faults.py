"""checkpoint/save_faults.py: a full, read-only or forbidden disk said as such, from however long
a library's error is."""
from checkpoint import save_faults, store

# tensorstore's message for a full disk, as it wrote it (a 4 MiB tmpfs): the errno's text at the end
FULL = ('RESOURCE_EXHAUSTED: Error writing "layers.0.input_layernorm.weight/c/0" in OCDBT database at local file '
        '"/w/checkpoints/step_00000002/arrays/ocdbt.process_0/": Failed writing: "/w/checkpoints/step_00000002/'
        'arrays/ocdbt.process_0/d/f80feb02216baea274ae84dca238d8ad.__lock": Failed to write 5488640 bytes to file 6: '
        'No space left on device [os_error_code=\'28\'] [source locations=\'tensorstore/internal/os/file_util.cc:1\']')


def test_a_long_library_error_keeps_its_cause_and_a_full_disk_is_said_as_such():
  err = store._error('/w/checkpoints/step_00000002', 'layers.0.input_layernorm.weight', ValueError(FULL),  # pylint: disable=protected-access
                     'written')
  assert 'No space left on device' in str(err) and 'source locations' not in str(err)
  assert str(err).startswith("array 'layers.0.input_layernorm.weight' in checkpoint /w/checkpoints/step_00000002 "
                             'could not be written: RESOURCE_EXHAUSTED: Error writing')
  said = save_faults.disk_fault(err, '/w/checkpoints/step_00000002')
  assert str(said).startswith('no space left on /w/checkpoints/step_00000002: this step is not committed')
  # the errno alone (another wording) is enough, through the chain of causes
  try:
    try:
      raise ValueError("RESOURCE_EXHAUSTED: ... [os_error_code='30']")
    except ValueError as cause:
      raise store.CheckpointError('could not be written') from cause
  except store.CheckpointError as chained:
    assert str(save_faults.disk_fault(chained, '/p')).startswith('a read-only file system at /p: ')
  other = ValueError('INVALID_ARGUMENT: something else')
  assert save_faults.disk_fault(other, '/p') is other and save_faults.disk_fault(None, '/p') is None
