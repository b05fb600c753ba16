"""MLPerf LoadGen run of the bundled tiny model (a stand-in with DeepSeek-R1's
architecture: MLA, MoE, an MTP head) under DeepSeek-R1's Server TTFT 2000 ms /
TPOT 80 ms and Interactive 1500 / 15 ms limits (p99, LoadGen mlperf.conf) x 2,
with MTP speculation (3 draft tokens) as the DeepSeek-R1 records serve it.
No DeepSeek-R1 weights: the rest is `mlperf_default_model.py`'s.

  python experiments/mlperf_harness.py --config=configs/mlperf_default_model_mtp.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_default_model.py"))
  with c.unlocked():
    c.speculative = 3
  return c
