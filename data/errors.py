"""The data pipeline's error: bad data files, tokenizers or data settings, named with the fix."""


class DataError(ValueError):
  """A data file, tokenizer or data setting that cannot be used as given."""
