"""Attention-DP step balance ("none" vs "split") in the Engine on a
data=2,expert=4 mesh of 8 simulated CPU devices, on a stream of mixed
long/short prompts.

`experiments/dp_balance.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/dp_balance.py --config=configs/dp_balance.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/dp_balance.py"
  c.lock()
  return c
