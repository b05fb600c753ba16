"""A resource report of every kernel case of `benchlib.gpu_cases`, compiled
for H100 on this CPU machine (with ptxas spill counts).

`experiments/kernel_report.py`'s default config (its fields are the flags' defaults):

  python experiments/kernel_report.py --config=configs/kernel_report.py --config.<field>=
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.script = "experiments/kernel_report.py"
  c.cases = config_dict.placeholder(str)  # comma-separated case names; None: every case
  c.ptxas = True  # run ptxas -v on each kernel's PTX for spill counts
  c.json_out = "experiments/results/kernel_report_h100.json"  # write the report here ('' to skip)
  c.lock()
  return c
