"""Wide-EP exchange bytes of one DeepSeek-V3 MoE layer compiled for H100s
(data=2,expert=4) on this CPU machine, at 1..64 tokens per rank.

`experiments/ep_bytes.py`'s default config (its fields are the flags' defaults):

  python experiments/ep_bytes.py --config=configs/ep_bytes.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/ep_bytes.py"
  c.model = "deepseek_v3"  # a preset (one MoE layer of it is compiled)
  c.mesh = "data=2,expert=4"  # the expert-parallel mesh of H100s
  c.tokens = ("1", "2", "4", "8", "16", "32", "64")  # tokens per rank
  c.out = config_dict.placeholder(str)  # None: experiments/results/ep_bytes
  c.lock()
  return c
