"""Weight-only quantization error on the bundled default model
(`experiments/benchlib/quant_error.py`): logits error and argmax agreement against
float32 for fp8, int8, int4, MXFP4 and NVFP4. Writes <out>.json.

  python experiments/quant_error.py
"""

from __future__ import annotations

import os

from absl import flags

from benchlib import cli, flag_config, quant_error, results

FLAGS = flags.FLAGS
flags.DEFINE_list("methods", list(quant_error.METHODS), "weight formats to measure")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "quant_error"),
                    "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  rows = quant_error.report(tuple(FLAGS.methods))
  print("| method | block | logits rel. error | argmax agreement | bytes vs float32 |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['method']} | {r['block']} | {r['logits_rel_err']:.4f} | "
          f"{r['argmax_agreement']:.3f} | {r['bytes_ratio']:.3f} |")
  results.write(FLAGS.out, rows)


if __name__ == "__main__":
  cli.run(main)
