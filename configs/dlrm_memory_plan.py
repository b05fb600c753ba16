"""DLRMv3's memory plan (the ~1 TB `dlrm_v3` preset) on 64 and 8 H100s, fp16,
int8 and fp8 tables, compiled from abstract params.

`experiments/dlrm_memory_plan.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  JAX_PLATFORMS=cpu python experiments/dlrm_memory_plan.py --config=configs/dlrm_memory_plan.py
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/dlrm_memory_plan.py"
  c.lock()
  return c
