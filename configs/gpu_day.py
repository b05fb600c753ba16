"""The GPU day on the GPU it finds: the GPU tests, the kernels against their
peers and the roofline, and the Engine at real widths, in a 450 s time box
(`dry_run=True`: CPU, tiny shapes).

`experiments/gpu_day.py`'s default config: it changes none of the flags' defaults, and
`benchlib.flag_config` fills every flag in as a field holding its default:

  python experiments/gpu_day.py --config=configs/gpu_day.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/gpu_day.py"
  # the kernels part's kernels, in this order (first measured first): the least
  # measured first, as benchlib.gpu_day.KERNEL_ORDER
  c.lock()
  return c
