"""Host time of an Engine decode step of bench_moe (random weights) on CPU,
batch 8, part by part.

`experiments/host_profile.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/host_profile.py --config=configs/host_profile.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/host_profile.py"
  c.lock()
  return c
