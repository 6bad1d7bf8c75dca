"""Hugging Face Llama directory <-> flatron checkpoint, and LoRA adapters <-> peft, bit-exact.

    python -m tools.convert hf-to-flatron --src=/models/llama --dst=runs/ft/checkpoints
    python -m tools.convert flatron-to-hf --src=runs/ft/checkpoints/step_00001000 --dst=/models/out
    python -m tools.convert export-peft --src=runs/lora/checkpoints/step_00000100 --dst=/adapters/mine
    python -m tools.convert merge-peft --src=/adapters/mine --base=/models/llama --dst=/models/merged
    python -m tools.convert nxd-to-hf --src=nxd_run/checkpoints --model_config=llama/config.json --dst=/models/out
    python -m tools.convert nxd-to-flatron --src=nxd_run/checkpoints --model_config=... --dst=runs/from_nxd/checkpoints
    python -m tools.convert flatron-to-nxd --src=runs/ft/checkpoints --dst=nxd_run/checkpoints --tp=32 --kv_replicator=4

A converted checkpoint is step 0 with parameters only; train from it with
`--config.exp_manager.init_from=<dst>/step_00000000` (or point init_from at the HF directory
directly: no conversion needed). Layout-free: any TP/PP/DP degree loads it. flatron-to-hf of
a LoRA step writes the merged model (W + scaling B A; the base comes from the run's init_from);
export-peft writes its adapters as a peft directory (`PeftModel.from_pretrained` loads it);
merge-peft folds any peft LoRA directory into its HF base. nxd-* read an NxD Training checkpoint
(a tag directory, or the directory of tags: its newest finished one) at whatever layout it was
saved, with no torch-xla; nxd-to-flatron keeps its step and consumed samples (parameters only:
NxD's optimizer files are not carried, and the run says so). flatron-to-nxd writes NxD's
HF-style modules at the --tp / --pp / --ep / --kv_replicator / --hw given (checkpoint/nxd_*.py).
"""
import json
import os

from absl import app, flags

import tools
import user_errors
from checkpoint import manager as managers, nxd_files, nxd_params, nxd_write, state as states, steps as checkpoint_steps
from configs import base as base_config
from data import tokenizer as tokenizers
from model import adapters, hf, lora
from optim import update
from parallel import mesh as meshes

FLAGS = flags.FLAGS
COMMANDS = ('hf-to-flatron', 'flatron-to-hf', 'export-peft', 'merge-peft', 'nxd-to-hf', 'nxd-to-flatron', 'flatron-to-nxd')
NXD_FROM = ('nxd-to-hf', 'nxd-to-flatron')


def hf_to_flatron(src, dst):
  """Write the HF model as step 0 of the checkpoint root `dst`; returns the step path."""
  config = base_config.get_config()             # the saved config: defaults around the HF model
  config.model, params = hf.load_hf(src, config.model)
  return _save_step(config, params, dst, 0, 0, converted_from=src)


def read_nxd(src, model_config, hw):
  """(config, parameters, progress) of the NxD checkpoint `src`: the model from `model_config`
  (an HF config.json or directory), the parameters merged from whatever layout it was saved at."""
  config = base_config.get_config()
  config.model = hf.read_config(model_config, config.model)
  tag = nxd_files.open_tag(src)
  return config, nxd_params.merge(tag, config.model, hw), dict(nxd_files.progress(tag), tag=tag)


def nxd_to_flatron(src, dst, model_config, hw):
  """NxD checkpoint `src` as a flatron step at its own step number (parameters only)."""
  config, params, progress = read_nxd(src, model_config, hw)
  step = _save_step(config, params, dst, progress['step'], progress['consumed_samples'] or 0,
                    converted_from=progress['tag'].path)
  return (f'{step} (step {progress["step"]}, {progress["consumed_samples"]} samples consumed; from tp '
          f'{progress["tag"].tp} pp {progress["tag"].pp} ep {progress["tag"].ep}; optimizer state not carried: '
          'moments start at zero)')


def flatron_to_nxd(src, dst, tp, pp, ep, kv_replicator, hw):
  """Checkpoint step `src` as an NxD Training tag under `dst` (HF-style modules)."""
  config, params = states.read_model(src)
  meta = checkpoint_steps.read_metadata(states.resolve_step(src))
  shards = nxd_write.split(lora.merged(params, config.model), config.model, tp, pp, ep, kv_replicator, hw)
  step = int(os.path.basename(states.resolve_step(src)).rsplit('_', 1)[-1])
  return nxd_write.write_tag(dst, shards, config.name or 'flatron', step, meta.get('consumed_samples', 0))


def _save_step(config, params, dst, step, consumed, **extra):
  updater = update.Updater(params, config, meshes.Mesh())
  layout = states.StateLayout(config, meshes.Mesh(), updater, state_keys=())
  manager = managers.CheckpointManager(dst)
  manager.save(step, layout.local_tensors(), layout.layouts(),
               states.step_metadata(config, meshes.Mesh(), consumed, (), 0, **extra))
  manager.wait()
  return manager.step_path(step)


def provenance(step):
  """(the HF directory checkpoint step `step`'s weights came from or None, the tokenizer section
  its run used or None), following init_from through flatron steps."""
  step = states.resolve_step(step)
  meta = checkpoint_steps.read_metadata(step)
  config = meta['config']
  tokenizer = config['data']['tokenizer'] if config['data']['tokenizer'].get('type', 'none') != 'none' else None
  source = meta.get('converted_from') or config['exp_manager'].get('init_from')
  if source and not hf.is_hf_dir(source) and checkpoint_steps.is_committed(source):
    source, inherited = provenance(source)
    tokenizer = tokenizer or inherited
  return (source if source and hf.is_hf_dir(source) else None), tokenizer


def carry_tokenizer(dst, source_dir=None, tokenizer_cfg=None, model_files=True):
  """Make the HF (or peft) directory `dst` self-contained: the tokenizer files of the run's
  tokenizer (or of the source model, when it is the same one), and with `model_files` the
  special token ids in its config.json and a generation_config.json (the source model's, its
  token ids those of the tokenizer carried). Returns what was carried, for the user."""
  generation = None
  if source_dir and os.path.isfile(os.path.join(source_dir, hf.GENERATION_FILE)):
    with open(os.path.join(source_dir, hf.GENERATION_FILE)) as f:
      generation = json.load(f)
  same = tokenizer_cfg is None or tokenizers.hf_directory(tokenizer_cfg) == os.path.abspath(source_dir or '')
  if same and source_dir and tokenizers.copy_hf_files(source_dir, dst):
    ids = dict(tokenizers.special_ids(tokenizers.from_directory(source_dir)), **hf.token_ids(source_dir))
    carried = f'the tokenizer of {source_dir}'
  elif tokenizer_cfg is not None:       # the source's generation settings, with this tokenizer's ids
    ids, carried = tokenizers.special_ids(tokenizers.write_hf_files(tokenizer_cfg, dst)), 'the run\'s tokenizer'
    generation = generation and dict(generation, **{k: v for k, v in ids.items() if v is not None})
  else:
    ids, carried = (hf.token_ids(source_dir) if source_dir else {}), 'no tokenizer (none is known)'
  if model_files:
    hf.write_generation_files(dst, ids, generation)
  return carried


def flatron_to_hf(src, dst):
  """Write checkpoint step `src` as a Hugging Face directory (LoRA merged in), with its
  tokenizer, special token ids and generation config."""
  config, params = states.read_model(src)
  model_cfg, note = _as_hf_routes(config.model)
  hf.save_hf(dst, model_cfg, lora.merged(params, model_cfg))
  return carry_tokenizer(dst, *provenance(src)) + note


def _as_hf_routes(model_cfg):
  """(the model section to export, a note): HF's Mixtral / Qwen2-MoE route every token, so a
  model trained with capacity dropping is exported dropless (as Megatron-LM's exports are)."""
  if not (model_cfg.get('moe') and model_cfg.moe.num_experts and not model_cfg.moe.dropless):
    return model_cfg, ''
  exported = model_cfg.copy_and_resolve_references()
  exported.moe.dropless = True
  return exported, (f'; exported dropless: HF routes every token, and the capacity it trained with '
                    f'(model.moe.capacity_factor={model_cfg.moe.capacity_factor}) is a training-time setting')


def export_peft(src, dst):
  """Write the LoRA adapters of checkpoint step `src` as a peft directory (with the tokenizer's
  files, as trainers save them)."""
  config, params = states.read_model(src)
  adapters.save_peft(dst, config.model, params, base_model_name_or_path=config.exp_manager.init_from)
  return carry_tokenizer(dst, *provenance(src), model_files=False)


def merge_peft(src, base, dst):
  """Fold the peft adapter directory `src` into the HF model `base`; write an HF directory with
  the base's tokenizer, special token ids and generation config."""
  model_cfg, params = hf.load_hf(base, base_config.get_config().model)
  model_cfg, params = adapters.load_peft(src, model_cfg, params)
  hf.save_hf(dst, model_cfg, lora.merged(params, model_cfg))
  return carry_tokenizer(dst, base)


def define_flags():
  flags.DEFINE_string('src', None, 'HF directory, flatron checkpoint step, or peft directory (merge-peft).')
  flags.DEFINE_string('dst', None, 'Checkpoint root (hf-to-flatron), HF directory, or peft directory.')
  flags.DEFINE_string('base', None, 'merge-peft: the HF directory of the adapter\'s base model.')
  flags.DEFINE_string('model_config', None, 'nxd-to-*: the model\'s HF config.json (or its directory).')
  flags.DEFINE_enum('hw', 'trn1', nxd_params.HW, 'nxd-*: the Trainium generation (its KV head order with kv_replicator).')
  flags.DEFINE_integer('tp', 1, 'flatron-to-nxd: tensor-parallel degree.')
  flags.DEFINE_integer('pp', 1, 'flatron-to-nxd: pipeline-parallel degree.')
  flags.DEFINE_integer('ep', 1, 'flatron-to-nxd: expert-parallel degree.')
  flags.DEFINE_integer('kv_replicator', 1, 'flatron-to-nxd: NxD\'s kv_replicator (tp / num_kv_heads when tp exceeds them).')


def check_command_line(argv, src, dst, base):
  """The subcommand named by argv (the program, then it); exits with one line saying what to
  fix when the command line cannot run."""
  usage = f'python -m tools.convert {{{"|".join(COMMANDS)}}} --src=... --dst=... (merge-peft: --base=...)'
  if len(argv) < 2:
    tools.fail(f'name a subcommand, then its flags: {usage}')
  command = argv[1]
  if command not in COMMANDS:
    tools.fail(f'unknown subcommand {command!r}; the subcommands are {", ".join(COMMANDS)}')
  if len(argv) > 2:
    tools.fail(f'unexpected arguments {" ".join(argv[2:])}: one subcommand, then flags: {usage}')
  if not (src and dst):
    tools.fail(f'{command} needs --src and --dst: {usage}')
  if command in NXD_FROM and not FLAGS.model_config:
    tools.fail(f'{command} needs --model_config (the model\'s HF config.json: NxD checkpoints hold no config)')
  if (command == 'merge-peft') != bool(base):
    tools.fail('merge-peft needs --base (the adapter\'s HF base model)' if command == 'merge-peft'
               else f'--base is for merge-peft only; leave it out of {command}')
  return command


def main(argv):
  """Errors a user can fix end in one line, exit 2 (user_errors.py)."""
  user_errors.exit_on_error(_main, argv, also=(ValueError,))


def _main(argv):
  command = check_command_line(argv, FLAGS.src, FLAGS.dst, FLAGS.base)
  if command == 'hf-to-flatron':
    print(hf_to_flatron(FLAGS.src, FLAGS.dst))
    return
  if command == 'nxd-to-hf':
    config, params, progress = read_nxd(FLAGS.src, FLAGS.model_config, FLAGS.hw)
    hf.save_hf(FLAGS.dst, config.model, params)
    print(f'{FLAGS.dst} (step {progress["step"]} of {progress["tag"].path})')
    return
  if command == 'nxd-to-flatron':
    print(nxd_to_flatron(FLAGS.src, FLAGS.dst, FLAGS.model_config, FLAGS.hw))
    return
  if command == 'flatron-to-nxd':
    print(flatron_to_nxd(FLAGS.src, FLAGS.dst, FLAGS.tp, FLAGS.pp, FLAGS.ep, FLAGS.kv_replicator, FLAGS.hw))
    return
  if command == 'merge-peft':
    carried = merge_peft(FLAGS.src, FLAGS.base, FLAGS.dst)
  else:
    carried = {'flatron-to-hf': flatron_to_hf, 'export-peft': export_peft}[command](FLAGS.src, FLAGS.dst)
  print(f'{FLAGS.dst} (with {carried})')


if __name__ == '__main__':
  define_flags()
  app.run(main)
