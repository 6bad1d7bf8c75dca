"""The repository's layout (docs/architecture.md): every import between folders points down the
layers, so no folder reaches back up and no two folders import each other; every source file
stays short enough to read in one sitting."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first: a folder (or top-level module) may import from the layers below its own only.
LAYERS = (
    ('rng', 'config_checks', 'user_errors', 'host_values'),   # keyed randomness, config check helpers, the user's
                                                             # errors, the values the step reads on the host
    ('numerics', 'data'),                  # precision recipes and stochastic rounding; datasets
    ('model',),                            # the single-device model: it knows no parallelism
    ('parallel',),                         # the runtime on a mesh: collectives, TP/SP/PP/CP/EP, ZeRO-1, the step
    ('optim',),                            # the update: optimizers by name, ZeRO-1's owned rows, rounding
    ('estimates', 'checkpoint', 'logs', 'monitor'),   # what a run costs; checkpoints; reports;
                                                      # trackers and the profiler
    ('configs', 'step_trace', 'validation'),   # config files, their validation, NxD YAML; one rank's step
                                             # traced; when and how a run evaluates
    ('train', 'tools'),                    # the loop and the command-line tools
)
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
MAX_LINES = 350


def _sources():
  for folder, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if not d.startswith('.') and d not in ('tests', 'runs', '__pycache__')]
    for name in files:
      if name.endswith('.py'):
        yield os.path.relpath(os.path.join(folder, name), ROOT)


def _room(path):
  return path.split(os.sep)[0].removesuffix('.py')


def _imported_rooms(path):
  """The project rooms `path` imports, at any depth of the file (imports inside functions too)."""
  with open(os.path.join(ROOT, path)) as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.module.split('.')[0], node.lineno
    elif isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name.split('.')[0], node.lineno


SOURCES = sorted(_sources())


def test_every_room_has_a_layer():
  rooms = {_room(p) for p in SOURCES}
  assert rooms <= set(LAYER), f'{sorted(rooms - set(LAYER))}: add them to LAYERS (and docs/architecture.md)'


def test_imports_point_down_the_layers():
  upward = [f'{path}:{line} imports {room} (layer {LAYER[room]}) from layer {LAYER[_room(path)]}'
            for path in SOURCES for room, line in _imported_rooms(path)
            if room in LAYER and room != _room(path) and LAYER[room] >= LAYER[_room(path)]]
  assert not upward, '\n'.join(upward)


def test_source_files_stay_short():
  long = []
  for path in SOURCES:
    with open(os.path.join(ROOT, path)) as f:
      lines = sum(1 for _ in f)
    if lines > MAX_LINES:
      long.append(f'{path}: {lines} lines')
  assert not long, f'split these along a seam (at most {MAX_LINES} lines each): {long}'
