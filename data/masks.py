"""Megatron's per-document options, from the end-of-document tokens inside each sample.

As megatron-core `_get_ltor_masks_and_position_ids`: a document ends at (and includes) an
EOD token of the input; the next token starts a new document.
  eod_mask_loss        loss_mask = 0 where the INPUT token is EOD, i.e. the model is not
                       trained to guess a new document's first token from the old document.
  reset_position_ids   position_ids restart at 0 at each document start.
  reset_attention_mask segment_ids = index of the document inside the sample, so attention
                       stays within a document (the model builds the mask from them).
"""
import numpy as np


def document_fields(tokens_bs: np.ndarray, eod_id: int, *, eod_mask_loss=False,
                    reset_position_ids=False, reset_attention_mask=False) -> dict:
  """loss_mask float32, position_ids int64 and (with reset_attention_mask) segment_ids int64."""
  b, s = tokens_bs.shape
  is_eod = tokens_bs == eod_id
  loss_mask = np.ones((b, s), np.float32)
  if eod_mask_loss:
    loss_mask[is_eod] = 0.0
  positions = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
  fields = {'loss_mask': loss_mask}
  starts_doc = np.zeros((b, s), bool)
  starts_doc[:, 1:] = is_eod[:, :-1]
  if reset_position_ids:
    doc_start = np.maximum.accumulate(np.where(starts_doc, positions, 0), axis=1)
    fields['position_ids'] = positions - doc_start
  else:
    fields['position_ids'] = positions.copy()
  if reset_attention_mask:
    fields['segment_ids'] = np.cumsum(starts_doc, axis=1, dtype=np.int64)
  return fields
