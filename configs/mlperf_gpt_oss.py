"""MLPerf GPT-OSS-120B scenario settings, on the bundled tiny model (the
harness serves it in place of GPT-OSS): Server TTFT 3000 ms / TPOT 80 ms and
Interactive 2000 / 15 ms (p99, LoadGen mlperf.conf) x 2; plain decoding
(GPT-OSS has no MTP head).
The rest is `mlperf_default_model.py`'s.

  python experiments/mlperf_harness.py --config=configs/mlperf_gpt_oss.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_default_model.py"))
  with c.unlocked():
    c.limits = "gpt-oss-120b"
    c.speculative = 0
  return c
