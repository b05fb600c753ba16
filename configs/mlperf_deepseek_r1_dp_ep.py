"""MLPerf DeepSeek-R1 as the records serve it, in miniature: the bundled tiny
model (R1's architecture: MLA, MoE, an MTP head) with attention data
parallelism and wide expert parallelism over 8 simulated CPU devices
(data=2 x expert=4: 8 attention-DP ranks, 8 experts one per rank) and MTP
speculation with 3 draft tokens per rank. The rest is `mlperf_deepseek_r1.py`'s.

  python experiments/mlperf_harness.py --config=configs/mlperf_deepseek_r1_dp_ep.py
"""

import pathlib

from ml_collections import config_dict

from benchlib.flag_config import load_config


def get_config() -> config_dict.ConfigDict:
  c = load_config(pathlib.Path(__file__).with_name("mlperf_deepseek_r1.py"))
  with c.unlocked():
    c.cpu_devices = 8
    c.mesh = "data=2,expert=4"
    c.layout = "dp_attn_ep"
  return c
