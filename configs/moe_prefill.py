"""MoE prefill variants of one bench_moe layer (random weights) on CPU at 512
tokens.

`experiments/moe_prefill.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/moe_prefill.py --config=configs/moe_prefill.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/moe_prefill.py"
  c.lock()
  return c
