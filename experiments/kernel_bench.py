"""Time the Pallas kernels against their peers and a roofline measured in the same run.

  python experiments/kernel_bench.py                          # GPU: the full sweep, bfloat16
  python experiments/kernel_bench.py --kernels=paged,mla --repeats=50
  python experiments/kernel_bench.py --shapes=tiny            # CPU smoke test, interpret mode
  python experiments/kernel_bench.py --dry_run                # every case's candidates, not run

Writes experiments/results/kernel_bench_<device kind>_<date>.json (a .png beside
it when matplotlib is installed) and prints a table: time, TFLOP/s (flash) or
GB/s (decode kernels), the fraction of the measured roofline, the error against
the float32 reference, and t_ours / t_peer for every peer that ran; then the
winner table (kernel_winners_<device kind>_<date>.json beside it): per case the
fastest candidate that matched the reference.
"""

import os

from absl import flags

from benchlib import cli, flag_config
from benchlib.kernels import KERNELS, SHAPES, list_candidates, run_kernel_bench

_KERNELS = flags.DEFINE_list("kernels", list(KERNELS), f"subset of {','.join(KERNELS)}")
_SHAPES = flags.DEFINE_enum("shapes", "default", list(SHAPES),
                            "default: the full sweep; gpu_day: fewer shapes, most telling first; "
                            "tiny: a few small shapes (CPU smoke test)")
_DTYPE = flags.DEFINE_string("dtype", None, "input dtype (default: bfloat16 on GPU, else float32)")
_INTERPRET = flags.DEFINE_bool("interpret", None,
                               "Pallas interpret mode (default: on iff not on a GPU)")
_REPEATS = flags.DEFINE_integer("repeats", 20, "timing samples per implementation (median)")
_WARMUP = flags.DEFINE_integer("warmup", 3, "untimed calls after the compiling one")
_PEERS = flags.DEFINE_bool("peers", True, "also time the peer implementations")
_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(__file__), "results"),
                               "where the JSON and the plot go")
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                              "list every case's candidates (and why any cannot run here); "
                              "compile and time nothing")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  if _DRY_RUN.value:
    list_candidates(kernels=_KERNELS.value, shapes=_SHAPES.value, dtype=_DTYPE.value,
                    peers=_PEERS.value)
    return
  run_kernel_bench(kernels=_KERNELS.value, shapes=_SHAPES.value, dtype=_DTYPE.value,
                   interpret=_INTERPRET.value, repeats=_REPEATS.value, warmup=_WARMUP.value,
                   peers=_PEERS.value, out_dir=_OUT_DIR.value)


if __name__ == "__main__":
  cli.run(main)
