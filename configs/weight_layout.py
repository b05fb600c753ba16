"""[In, Out] vs [Out, In] float32 projections on XLA:CPU for two bench_dense
shapes (1024x5632, 2816x1024) at 1, 8, 32 rows.

`experiments/weight_layout.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/weight_layout.py --config=configs/weight_layout.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/weight_layout.py"
  c.lock()
  return c
