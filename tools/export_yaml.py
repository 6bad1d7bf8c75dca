"""A flatron config written as NxD Training YAML (the other way: configs/nxdt.py reads it).

    python tools/export_yaml.py --config=configs/llama7b.py > llama7b.yaml
    python tools/export_yaml.py --config=configs/smollm2_lora.py --config.trainer.max_steps=50 --out=lora.yaml

Every key lands at its NxD Training place and name (e.g. data.seq_length also as
model.encoder_seq_length, model.optim.do_layer_norm_weight_decay as model.do_layer_norm_weight_decay);
flatron's own keys keep their paths, so `--config=configs/nxdt.py:llama7b.yaml` gives back the
same config.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from configs import nxdt  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py[:preset]).')
_OUT = flags.DEFINE_string('out', None, 'Write the YAML here (default: standard output).')


def main(argv):
  del argv
  text = nxdt.to_yaml(_CONFIG.value)
  if _OUT.value:
    with open(_OUT.value, 'w', encoding='utf-8') as f:
      f.write(text)
  else:
    sys.stdout.write(text)


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
