"""The GPU day on the GPU it finds: the GPU tests, the kernels against their
peers and the roofline, and the Engine at real widths, in a 450 s time box
(`dry_run=True`: CPU, tiny shapes).

`experiments/gpu_day.py`'s default config (its fields are the flags' defaults):

  python experiments/gpu_day.py --config=configs/gpu_day.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/gpu_day.py"
  c.out_dir = config_dict.placeholder(str)  # None: experiments/results/gpu
  c.dry_run = False  # CPU, tiny shapes, Pallas interpreted
  c.budget_s = 450.0  # the whole run's time box, seconds
  c.parts = ("tests", "kernels", "engine")  # subset of tests,kernels,engine
  # the kernels part's kernels, in this order (first measured first): the least
  # measured first, as benchlib.gpu_day.KERNEL_ORDER
  c.kernels = ("mla", "ragged", "paged", "gmm", "flash", "qmatmul")
  c.lock()
  return c
