"""Stand-in data: micro batches with the fields, shapes and dtypes the config's own data
would give, made up without reading any file (the traced dry run: step_trace.py).

The loader and the sources are the real ones (data/loader.py, sft.py, preference.py); only the
samples are invented: the synthetic stream for pretraining corpora, and for SFT or preference
records one pre-tokenized example filling each row (a full row: the longest sequence the data
can give), so every field of a real micro batch is there at its real size.
"""
from data import loader as loaders, preference, sft, synthetic
from data.sft_records import Record

# the end-of-document id the stand-in samples use where the config resets on documents (the
# real one comes from the tokenizer, which a dry run need not have)
EOD_ID = 0


def loader(config, dp_rank=0, dp_size=1) -> loaders.Loader:
  """A train-split Loader over stand-in samples for `config` (global_batch as the real one)."""
  d, n = config.data, config.data.seq_length
  rows = max(1, d.global_batch_size)
  if config.model.objective in preference.OBJECTIVES:
    prompt = n // 4              # both sides share the row: the prompt twice, then each response
    response = (n + 1 - 2 * prompt) // 2
    pair = {'prompt_input_ids': [1] * prompt, 'chosen_input_ids': [2] * response,
            'rejected_input_ids': [3] * response}
    source = preference.PreferenceSource(config, 'train', [Record(f'stand-in {i}', pair) for i in range(rows)])
  elif sft.settings(config)['train_dir']:
    example = {'input_ids': [1] * (n + 1), 'loss_mask': [1] * (n + 1)}
    source = sft.SFTSource(config, 'train', [Record(f'stand-in {i}', example) for i in range(rows)])
  else:
    source = synthetic.SyntheticSource(config, 'train')
  resets = d.eod_mask_loss or d.reset_position_ids or d.reset_attention_mask
  return loaders.Loader(config, 'train', dp_rank, dp_size, source=source, eod_id=EOD_ID if resets else None)
