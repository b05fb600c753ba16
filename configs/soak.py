"""A 10-minute serving soak on the bundled default model (plain, then MTP with
2 drafts): random arrivals, aborts, worker stops, stalled KV transfers.

`experiments/soak.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/soak.py --config=configs/soak.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/soak.py"
  c.lock()
  return c
