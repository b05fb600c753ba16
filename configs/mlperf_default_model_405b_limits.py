"""MLPerf LoadGen run of the bundled tiny model under Llama-3.1-405B's
scenario limits: Server TTFT 6000 ms / TPOT 175 ms and Interactive 4500 /
80 ms (p99, LoadGen mlperf.conf) x 2; plain decoding (Llama-3.1 has no MTP
head). No 405B weights: the harness serves the bundled model, and the rest
is `mlperf_default_model.py`'s.

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_405b_limits.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_default_model.py"))
  with c.unlocked():
    c.limits = "llama3.1-405b"
  return c
