"""The Mosaic GPU paged decode kernel's tuning sweep on a GPU
(`dry_run=True`: CPU, tiny shapes, interpret mode).

`experiments/mosaic_tune.py`'s default config (its fields are the flags' defaults):

  python experiments/mosaic_tune.py --config=configs/mosaic_tune.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/mosaic_tune.py"
  c.out = "/tmp/mosaic_tune.json"  # the JSON written
  c.dry_run = False  # CPU: tiny shapes, interpret mode
  c.repeats = 10  # timed samples per variant
  c.lock()
  return c
