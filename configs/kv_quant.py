"""fp8 / int8 KV cache against the full-precision cache on the bundled
default model: 32 stdlib prompts, 32 greedy tokens each, XLA attention.

`experiments/kv_quant.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/kv_quant.py --config=configs/kv_quant.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kv_quant.py"
  c.lock()
  return c
