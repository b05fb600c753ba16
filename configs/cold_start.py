"""A server's cold start (an empty compilation cache) and warm start, timed
from the command to the first completed request.

`experiments/cold_start.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/cold_start.py --config=configs/cold_start.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/cold_start.py"
  c.lock()
  return c
