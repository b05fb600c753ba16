"""DLRMv3's memory plan (the ~1 TB `dlrm_v3` preset) on 64 and 8 H100s, fp16,
int8 and fp8 tables, compiled from abstract params.

`experiments/dlrm_memory_plan.py`'s default config (its fields are the flags' defaults):

  JAX_PLATFORMS=cpu python experiments/dlrm_memory_plan.py --config=configs/dlrm_memory_plan.py
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/dlrm_memory_plan.py"
  c.recsys_preset = "dlrm_v3"  # recsys preset
  c.devices = ("64", "8")  # H100 counts
  c.quant = ("none", "int8", "float8_e4m3fn")  # table formats
  c.out = config_dict.placeholder(str)  # None: experiments/results/dlrm_memory_plan
  c.lock()
  return c
