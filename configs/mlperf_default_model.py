"""MLPerf LoadGen run of the bundled tiny model, as `experiments/mlperf_harness.py`
runs it without a config: Offline, Server and Interactive under DeepSeek-R1's
latency limits x 2 (a small model on a 2-core CPU), held-out stdlib prompts.

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model.py
  python experiments/mlperf_harness.py --config=configs/mlperf_default_model.py \
      --config.scenarios=Server --config.search=True
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/mlperf_harness.py"  # its flags' defaults, nothing changed
  c.lock()
  return c
