"""MLPerf LoadGen run of the bundled tiny model served as the DeepSeek-R1
records serve R1, in miniature: attention data parallelism and wide expert
parallelism over 8 simulated CPU devices (data=2 x expert=4: 8 attention-DP
ranks, 8 experts one per rank) and MTP speculation with 3 draft tokens per
rank. The rest is `mlperf_default_model_mtp.py`'s (R1's latency limits x 2).

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_mtp_dp_ep.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_default_model_mtp.py"))
  with c.unlocked():
    c.cpu_devices = 8
    c.mesh = "data=2,expert=4"
  return c
