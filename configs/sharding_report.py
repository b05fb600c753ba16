"""DeepSeek-V3 (bfloat16) sharded dp_attn_ep on a data=8,expert=32 mesh: per-device
bytes, collectives and shardings, from shapes alone.

`experiments/sharding_report.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/sharding_report.py --config=configs/sharding_report.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/sharding_report.py"
  c.lock()
  return c
