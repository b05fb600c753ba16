"""MoE prefill variants of one bench_moe layer (random weights) on CPU at 512
tokens.

`experiments/moe_prefill.py`'s default config (its fields are the flags' defaults):

  python experiments/moe_prefill.py --config=configs/moe_prefill.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/moe_prefill.py"
  c.model = "bench_moe"  # preset with MoE layers
  c.tokens = ("512",)  # prefill tokens per call
  c.repeats = 5  # timed calls per variant (median)
  c.out = "experiments/results/moe_prefill"  # output prefix (.json)
  c.lock()
  return c
