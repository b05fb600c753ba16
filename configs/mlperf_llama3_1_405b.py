"""MLPerf Llama-3.1-405B scenario settings, on the bundled tiny model (the
harness serves it in place of the 405B model): Server TTFT 6000 ms / TPOT
175 ms and Interactive 4500 / 80 ms (p99, LoadGen mlperf.conf) x 2; plain
decoding (Llama-3.1 has no MTP head).
The rest is `mlperf_default_model.py`'s.

  python experiments/mlperf_harness.py --config=configs/mlperf_llama3_1_405b.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_default_model.py"))
  with c.unlocked():
    c.limits = "llama3.1-405b"
    c.speculative = 0
  return c
