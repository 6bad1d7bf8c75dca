"""The data pipeline's error: bad data files, tokenizers or data settings, named with the fix."""
from user_errors import UserError


class DataError(UserError, ValueError):
  """A data file, tokenizer or data setting that cannot be used as given."""
