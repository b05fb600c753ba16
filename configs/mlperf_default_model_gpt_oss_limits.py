"""MLPerf LoadGen run of the bundled tiny model under GPT-OSS-120B's
scenario limits: Server TTFT 3000 ms / TPOT 80 ms and Interactive 2000 /
15 ms (p99, LoadGen mlperf.conf) x 2; plain decoding (GPT-OSS has no MTP
head). No GPT-OSS weights: the harness serves the bundled model, and the
rest is `mlperf_default_model.py`'s.

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_gpt_oss_limits.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_default_model.py"))
  with c.unlocked():
    c.limits = "gpt-oss-120b"
  return c
