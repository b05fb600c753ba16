"""Host time of an Engine decode step of bench_moe (random weights) on CPU,
batch 8, part by part.

`experiments/host_profile.py`'s default config (its fields are the flags' defaults):

  python experiments/host_profile.py --config=configs/host_profile.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/host_profile.py"
  c.model = "bench_moe"  # preset
  c.batch = 8  # decoding sequences
  c.decode_steps = 1  # EngineConfig.decode_steps
  c.out = config_dict.placeholder(str)
  c.lock()
  return c
