"""Wide-EP exchange bytes of one DeepSeek-V3 MoE layer compiled for H100s
(data=2,expert=4) on this CPU machine, at 1..64 tokens per rank.

`experiments/ep_bytes.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/ep_bytes.py --config=configs/ep_bytes.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/ep_bytes.py"
  c.lock()
  return c
