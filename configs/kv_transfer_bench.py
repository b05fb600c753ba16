"""KV transfer bytes/s between two Ray worker processes of the bundled
default model, 1..256 pages, by the jax and object-store transports.

`experiments/kv_transfer_bench.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/kv_transfer_bench.py --config=configs/kv_transfer_bench.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kv_transfer_bench.py"
  c.lock()
  return c
