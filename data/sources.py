"""Sample sources by name: `data.source` names the one the Loader reads (data/loader.py).

A source is built by its factory, `factory(config, split) -> source` (split: train, valid or
test), and has one of two interfaces; the Loader tells them apart by what the source has:
  token windows   samples(sample_ids) -> int64 array [len(sample_ids), seq_length + 1]
                  (the loader shifts tokens and labels, and builds the masks and positions)
                  samples_per_epoch: samples in one pass over the split; None when endless
  records         micro_batch(sample_ids) -> dict of the loader's tensors, sample_ids included
                  row_ids(sample_ids) -> int64 array: the rows served (DPO keeps its reference
                  log-probs by row); samples_per_epoch as above; summary() -> str, the line
                  logged at start-up (data/sft.py's SFTSource is the model)
Sample i must be a pure function of the config and i, whatever was asked before: resuming at
`consumed_samples` then continues exactly, at any DP degree.

Built in: synthetic, indexed (data.data_prefix), sft and preference (data.train_dir), text
(data.text.train). `auto` (the default) picks preference pairs when model.objective is dpo or
orpo, SFT records when data.train_dir is set, the indexed corpus when data.data_prefix is, text
when data.text.train is, else the synthetic stream. A fork adds its own:

    @sources.register('shards', needs={'data.shards.path': 'the shard files'})
    def shards(config, split):
      return MyShards(config.data.shards.path, split, config.data.seq_length)

`needs`: keys that must be set when the source is named; `claims`: keys only it reads (needs
are claims too). A named source is refused while another's claimed key is set, since that
setting would go unused. A key is set when it is not None, empty, 0 or False (model.objective:
when not next_token).
"""
import typing

from data import blend, gpt_dataset, preference, sft, synthetic, text
from data.errors import DataError

AUTO = 'auto'
# the sources `auto` chooses among by precedence (train_dir over data_prefix, ...), as it always
# has; a conflict with any other source's keys is refused under auto too
PRECEDENCE = ('preference', 'sft', 'indexed', 'synthetic')
UNSET = {'model.objective': 'next_token'}    # a key whose default is not empty


class Entry(typing.NamedTuple):
  factory: typing.Callable
  needs: dict          # key -> what it holds (for the message when it is missing)
  claims: tuple


REGISTRY = {}


def register(name, factory=None, *, needs=None, claims=()):
  """Make `factory(config, split)` the source `data.source=name`; a decorator without factory."""
  def add(f):
    REGISTRY[name] = Entry(f, dict(needs or {}), tuple(dict.fromkeys(tuple(needs or ()) + tuple(claims))))
    return f
  return add if factory is None else add(factory)


def names() -> list:
  return sorted(REGISTRY)


def lookup(config, key):
  """The value of dotted `key` in config (None where the config has no such key)."""
  node = config
  for part in key.split('.'):
    if not hasattr(node, 'get') or part not in node:
      return None
    node = node[part]
  return node


def is_set(config, key) -> bool:
  value = lookup(config, key)
  return value not in (None, '', (), [], 0, False) and value != UNSET.get(key)


def resolve(config) -> str:
  """The source's name: data.source, or auto's choice (not checked: see `check`)."""
  name = config.data.get('source', AUTO)
  if name != AUTO:
    return name
  if config.model.objective in preference.OBJECTIVES:
    return 'preference'
  for source, key in (('sft', 'data.train_dir'), ('indexed', 'data.data_prefix'), ('text', 'data.text.train')):
    if is_set(config, key):
      return source
  return 'synthetic'


def check(config) -> list:
  """Problems with data.source: an unknown name, a missing setting, a setting left unused."""
  given, name = config.data.get('source', AUTO), resolve(config)
  if name not in REGISTRY:
    return [f'data.source={given!r} is not a registered source; registered: {AUTO}, {", ".join(names())}']
  said = f'data.source={given!r}' if given != AUTO else f'data.source={AUTO!r} (choosing {name!r})'
  problems = []
  for key, what in REGISTRY[name].needs.items():
    if given != AUTO and not is_set(config, key):     # (auto's choices say what they miss themselves)
      problems.append(f'{said} needs {key} ({what}), but {key}={lookup(config, key)!r}; set {key}, or '
                      'choose another data.source')
  owners = {}                 # key -> the other sources that read it
  for other, entry in REGISTRY.items():
    if other != name and not (given == AUTO and name in PRECEDENCE and other in PRECEDENCE):
      for key in entry.claims:
        owners.setdefault(key, []).append(repr(other))
  for key, others in owners.items():
    if key not in REGISTRY[name].claims and is_set(config, key):
      unset = f'set {key}={UNSET[key]!r}' if key in UNSET else f'unset {key}'
      problems.append(f'{said} does not read {key}={lookup(config, key)!r} (the {" or ".join(others)} source\'s): '
                      f'{unset}, or set data.source={" or ".join(others)}')
  return problems


def make(config, split):
  """The source data.source names, for `split`; a DataError when the config's choice is wrong."""
  problems = check(config)
  if problems:
    raise DataError('; '.join(problems))
  return REGISTRY[resolve(config)].factory(config, split)


# --- the built-in sources ---------------------------------------------------------------


register('synthetic', synthetic.SyntheticSource, claims=('data.synthetic_vocab_size',))
register('sft', sft.SFTSource, needs={'data.train_dir': 'the SFT records'},
         claims=('data.val_dir', 'data.test_dir', 'data.dev_choose_samples'))
register('preference', preference.PreferenceSource,
         needs={'data.train_dir': 'the preference records', 'model.objective': 'dpo or orpo'},
         claims=('data.val_dir', 'data.test_dir', 'data.dev_choose_samples'))
register('text', text.TextSource, needs={'data.text.train': '.jsonl / .parquet files or globs'},
         claims=('data.text.valid', 'data.text.test'))


@register('indexed', needs={'data.data_prefix': 'Megatron .bin/.idx prefixes'})
def corpus_source(config, split):
  """The GPTDataset of one prefix, or the BlendedDataset of several, for `split`."""
  c = config.data
  datasets, weights = [], []
  for weight, prefix in blend.parse_data_prefix(c.data_prefix):
    datasets.append(gpt_dataset.GPTDataset(
        prefix, split, c.seq_length, config.seed, c.splits_string,
        cache_dir=c.get('index_mapping_dir'), vocab_size=config.model.vocab_size))
    weights.append(weight)
  return datasets[0] if len(datasets) == 1 else blend.BlendedDataset(datasets, weights)
