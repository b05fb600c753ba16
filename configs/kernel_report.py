"""A resource report of every kernel case of `benchlib.gpu_cases`, compiled
for H100 on this CPU machine (with ptxas spill counts).

`experiments/kernel_report.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/kernel_report.py --config=configs/kernel_report.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kernel_report.py"
  c.lock()
  return c
