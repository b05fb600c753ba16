"""Llama-3-8B's Engine step programs compiled for one H100 (mesh data=1,
layout tp) from this CPU machine: memory per device and a roofline step
time at batch 32, 4096 tokens of context.

`experiments/gpu_plan.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/gpu_plan.py --config=configs/gpu_plan.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/gpu_plan.py"
  # compile the preset with this many layers (its dense-first layers as the preset has them)
  # how the steps hold the weights: per_layer (a GPU Engine's default) or stacked (scanned)
  c.lock()
  return c
