"""The first name of configs/nxd_yaml.py, kept so existing commands keep working:
--config=configs/nxdt.py:file.yaml is --config=configs/nxd_yaml.py:file.yaml."""
from configs.nxd_yaml import get_config  # pylint: disable=unused-import
