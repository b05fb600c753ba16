"""The cluster simulator's scale study: DeepSeek-V3 simulated on 8..288 GPUs
(GB300, B200, H200, H100): EP sizes, co-located vs disaggregated, MTP,
routing, $/M tokens. `mode="calibrate_check"` instead fits this machine's
step times on the tiny_dense preset and checks the real engine.

`experiments/simulate_cluster.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/simulate_cluster.py --config=configs/simulate_cluster.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/simulate_cluster.py"
  c.lock()
  return c
