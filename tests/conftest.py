"""The suite never reads this machine's planner calibration (~/.cache/flatron/local_cluster.json,
written by `python -m tools.plan --calibrate`): every test, and every process it spawns, sees
the uncalibrated `local` defaults, as CI does."""
import os

os.environ['FLATRON_CLUSTER_FILE'] = os.devnull      # not a regular file: estimates/clusters.py's defaults
