"""Wide-EP exchange bytes per MoE layer, step and rank, from programs compiled
for H100s on this CPU machine (`experiments/benchlib/ep_bytes.py`): the worst-case
buffers used before, the capacity exchange (the CPU path) and the ragged
all-to-all (the GPU path), against the bytes actually routed. Writes <out>.json.

  python experiments/ep_bytes.py                                  # DeepSeek-V3 layer, 8 H100s
  python experiments/ep_bytes.py --model=tiny_moe --tokens=1,64
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs; nothing runs on one

from absl import flags  # noqa: E402

from benchlib import cli, ep_bytes, flag_config, model_flags, results  # noqa: E402
from benchlib.sharding_report import parse_mesh  # noqa: E402
from jaxinfer import Backend, gpu_compile, presets  # noqa: E402

FLAGS = flags.FLAGS
_MODEL = model_flags.define_preset("deepseek_v3")  # one MoE layer of it is compiled
flags.DEFINE_string("mesh", "data=2,expert=4", "the expert-parallel mesh of H100s")
flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16", "32", "64"], "tokens per rank")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results", "ep_bytes"),
                    "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  cfg = presets.get(_MODEL.value, dtype="bfloat16")
  mesh = gpu_compile.mesh(parse_mesh(FLAGS.mesh))
  rows = ep_bytes.report(cfg, mesh, [int(t) for t in FLAGS.tokens],
                         backend=Backend(target="gpu"))
  print("| tokens/rank | routed KiB | before | capacity (CPU) | ragged (GPU) |")
  print("|---|---|---|---|---|")
  for r in rows:
    cells = [f"{r[k]['bytes'] / 1024:.0f} KiB ({r[k]['ratio']:.2f}x)"
             for k in ("before", "capacity", "ragged")]
    print(f"| {r['tokens_per_rank']} | {r['routed_bytes'] / 1024:.0f} | " + " | ".join(cells) + " |")
  results.write(FLAGS.out, rows, None, preset=_MODEL.value, mesh=FLAGS.mesh, gpu="h100",
                note="per MoE layer, step and rank; dispatch + combine activation rows; "
                     "capacity per round (one round when no destination exceeds C rows); "
                     "ragged moves its send_sizes rows, the routed copies")


if __name__ == "__main__":
  cli.run(main)
