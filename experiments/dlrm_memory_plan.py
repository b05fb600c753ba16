"""DLRMv3's memory plan on H100s (`jaxinfer.recsys.memory.plan`): the ~1 TB
`dlrm_v3` preset compiled from abstract params for each device count and
table format, with the per-device bytes and whether it fits. Compile-only:
runs on a CPU machine with the gpu-compile extra (JAX_PLATFORMS=cpu).

  JAX_PLATFORMS=cpu python experiments/dlrm_memory_plan.py
"""

from __future__ import annotations

import os

from absl import flags

from benchlib import cli, flag_config, results
from jaxinfer.recsys import family, memory

FLAGS = flags.FLAGS
flags.DEFINE_string("recsys_preset", "dlrm_v3", "recsys preset (jaxinfer.recsys.family.PRESETS)")
flags.DEFINE_list("devices", ["64", "8"], "H100 counts to plan for")
flags.DEFINE_list("quant", ["none", "int8", "float8_e4m3fn"], "table formats: none | int8 | float8_e4m3fn")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "dlrm_memory_plan"),
                    "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  cfg = family.get(FLAGS.recsys_preset)
  rows = []
  for devices in (int(d) for d in FLAGS.devices):
    for q in FLAGS.quant:
      p = memory.plan(cfg, devices=devices, quant=None if q == "none" else q)
      print(p.summary())
      rows.append(dict(devices=devices, quant=q, table_bytes=p.table_bytes,
                       argument_bytes=p.memory.argument_bytes, temp_bytes=p.memory.temp_bytes,
                       peak_bytes=p.memory.peak_bytes, hbm_bytes=p.hbm_bytes, fits=p.fits))
  results.write(FLAGS.out, rows, preset=FLAGS.recsys_preset)


if __name__ == "__main__":
  cli.run(main)
