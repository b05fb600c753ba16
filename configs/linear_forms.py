"""XLA:CPU's dot vs multiply-reduce projections for float32, int8, fp8 and int4
weights at 1..512 rows, under the default XLA_FLAGS only (no Engine cells).

`experiments/linear_forms.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/linear_forms.py --config=configs/linear_forms.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/linear_forms.py"
  c.lock()
  return c
