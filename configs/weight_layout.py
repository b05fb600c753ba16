"""[In, Out] vs [Out, In] float32 projections on XLA:CPU for two bench_dense
shapes (1024x5632, 2816x1024) at 1, 8, 32 rows.

`experiments/weight_layout.py`'s default config (its fields are the flags' defaults):

  python experiments/weight_layout.py --config=configs/weight_layout.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/weight_layout.py"
  c.shapes = ("1024x5632", "2816x1024")  # d_in x d_out shapes
  c.out = "experiments/results/weight_layout"  # output prefix (.json)
  c.lock()
  return c
