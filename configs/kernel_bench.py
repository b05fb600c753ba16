"""Every Pallas kernel at the default shapes against its peers and a roofline
measured in the same run (bfloat16 on a GPU, float32 interpreted elsewhere).

`experiments/kernel_bench.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/kernel_bench.py --config=configs/kernel_bench.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kernel_bench.py"
  c.lock()
  return c
