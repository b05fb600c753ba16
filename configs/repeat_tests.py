"""The multi-device and serving test files (the script's list), run 20 times
with `pytest -n 2`.

`experiments/repeat_tests.py`'s default config (its fields are the flags' defaults):

  python experiments/repeat_tests.py --config=configs/repeat_tests.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/repeat_tests.py"
  c.runs = 20  # runs at most
  # Comma-separated test files or ids; None: the script's multi-device and serving test files.
  c.tests = config_dict.placeholder(str)
  c.workers = 2  # pytest -n
  c.until_s = 0  # start no run after this many seconds (0: no limit)
  c.keep_going = False  # go on after a run that did not pass
  c.out = config_dict.placeholder(str)
  c.lock()
  return c
