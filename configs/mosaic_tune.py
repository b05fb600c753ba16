"""The Mosaic GPU paged decode kernel's tuning sweep on a GPU
(`dry_run=True`: CPU, tiny shapes, interpret mode).

`experiments/mosaic_tune.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/mosaic_tune.py --config=configs/mosaic_tune.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/mosaic_tune.py"
  c.lock()
  return c
