"""A resource report per kernel case (benchlib.kernel_report): each case
of experiments/benchlib/gpu_cases.py compiled for its GPU on this CPU machine, with
shared memory, registers and spills read from the executable, and planned vs
minimum HBM bytes and the roofline from the shapes.

  python experiments/kernel_report.py                       # all cases -> results JSON
  python experiments/kernel_report.py --cases llama8b_decode_ps16,dsv3_mla_dp_decode_ps64

Needs the gpu-compile extra (CUDA PJRT plugin + ptxas); run with JAX_PLATFORMS=cpu.
"""

import os

# Compile-only GPUs need no GPU: keep the CUDA plugin from trying to start one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags

from benchlib import cli, flag_config
from benchlib.kernel_report import HEADER, run_report

_CASES = flags.DEFINE_list("cases", None, "case names (default: every case of gpu_cases)")
_PTXAS = flags.DEFINE_bool("ptxas", True, "run ptxas -v on each kernel's PTX for spill counts")
_JSON_OUT = flags.DEFINE_string("json_out", "experiments/results/kernel_report_h100.json",
                                "write the report here ('' to skip)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  print(HEADER)
  run_report(names=_CASES.value, ptxas=_PTXAS.value, json_out=_JSON_OUT.value or None)


if __name__ == "__main__":
  cli.run(main)
