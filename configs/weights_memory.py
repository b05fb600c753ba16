"""Host memory (RSS) of an Engine's weights on CPU against the weight bytes,
for bench_dense and bench_moe (random weights).

`experiments/weights_memory.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/weights_memory.py --config=configs/weights_memory.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/weights_memory.py"
  c.lock()
  return c
