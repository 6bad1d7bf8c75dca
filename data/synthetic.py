"""A learnable synthetic token stream for runs without a corpus (`data.data_prefix = ()`).

Each sample is a walk on a fixed random Markov chain: every token has 4 possible successors,
so a model can drive its loss from ln(V) towards ln(4) nats. Sample i of a split is a pure
function of (seed, split, i): any layout and any resume point see the same tokens.
"""
import numpy as np

import rng

BRANCHING = 4


class SyntheticSource:

  def __init__(self, config, split):
    self.vocab = config.data.synthetic_vocab_size or config.model.vocab_size
    self.seq_length = config.data.seq_length
    self.seed, self.split = config.seed, split
    table_rng = np.random.default_rng(rng.key_to_seed(config.seed, 'synthetic_chain'))
    self.successors = table_rng.integers(0, self.vocab, size=(self.vocab, BRANCHING))

  def samples(self, sample_ids) -> np.ndarray:
    """int64 [len(sample_ids), seq_length + 1]."""
    out = np.empty((len(sample_ids), self.seq_length + 1), dtype=np.int64)
    for row, i in enumerate(sample_ids):
      g = np.random.default_rng(rng.key_to_seed(self.seed, 'synthetic', self.split, int(i)))
      choices = g.integers(0, BRANCHING, size=self.seq_length)
      tok = g.integers(0, self.vocab)
      out[row, 0] = tok
      for t in range(self.seq_length):
        tok = self.successors[tok, choices[t]]
        out[row, t + 1] = tok
    return out
