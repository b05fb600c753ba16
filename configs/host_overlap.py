"""The Engine's host work per decode step against its device step, on a
model of 32 narrow layers at batch 1, 64 and 256, and with the device part
made slow on purpose.

`experiments/host_overlap.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/host_overlap.py --config=configs/host_overlap.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/host_overlap.py"
  c.lock()
  return c
