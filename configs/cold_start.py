"""A server's cold start (an empty compilation cache) and warm start, timed
from the command to the first completed request.

`experiments/cold_start.py`'s default config (its fields are the flags' defaults):

  python experiments/cold_start.py --config=configs/cold_start.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/cold_start.py"
  c.serve_flags = ()  # flags passed on to serve.py
  c.wait_warm = False  # wait for /health to say ok (the whole background warm-up) in each start
  c.timeout_s = 1800.0  # longest wait for each start
  c.machine = "epyc2c"  # short machine name for the output file
  c.out = config_dict.placeholder(str)
  c.lock()
  return c
