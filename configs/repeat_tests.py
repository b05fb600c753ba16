"""The multi-device and serving test files (the script's list), run 20 times
with `pytest -n 2`.

`experiments/repeat_tests.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/repeat_tests.py --config=configs/repeat_tests.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/repeat_tests.py"
  # Comma-separated test files or ids; None: the script's multi-device and serving test files.
  c.lock()
  return c
