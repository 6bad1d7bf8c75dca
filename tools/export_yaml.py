"""A flatron config written as NxD Training YAML (the other way: configs/nxd_yaml.py reads it).

    python -m tools.export_yaml --config=configs/llama7b.py > llama7b.yaml
    python -m tools.export_yaml --config=configs/smollm2_lora.py --config.trainer.max_steps=50 --out=lora.yaml

Every key lands at its NxD Training place and name (e.g. data.seq_length also as
model.encoder_seq_length, model.optim.do_layer_norm_weight_decay as model.do_layer_norm_weight_decay);
flatron's own keys keep their paths, so `--config=configs/nxd_yaml.py:llama7b.yaml` gives back the
same config.
"""
import sys

from absl import app, flags
from ml_collections import config_flags

import tools
from configs import nxd_yaml

FLAGS = flags.FLAGS


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).')
  flags.mark_flag_as_required('config')
  flags.DEFINE_string('out', None, 'Write the YAML here (default: standard output).')


def main(argv):
  tools.no_arguments(argv)
  text = nxd_yaml.to_yaml(FLAGS.config)
  if FLAGS.out:
    with open(FLAGS.out, 'w', encoding='utf-8') as f:
      f.write(text)
  else:
    sys.stdout.write(text)


if __name__ == '__main__':
  define_flags()
  app.run(main)
