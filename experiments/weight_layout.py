"""Which way float32 projection weights multiply fastest on this machine:
XLA:CPU's [In, Out], [Out, In] as rows x w^T, or [Out, In] into [Out, rows],
or the C++ kernel's 32-column panels where it builds
(`jaxinfer.engine.weight_layout`: the probe whose result, kept on disk by
`weight_layout.probe` or `python -m jaxinfer.engine.cpu_setup`,
`EngineConfig.cpu_weight_layout="auto"` reads), at 1, 8 and 32 rows,
weights streaming from memory.

  python experiments/weight_layout.py                    # bench_dense's gate-up, 1024 x 5632
  python experiments/weight_layout.py --shapes=1024x5632,2816x1024,4096x28672

Writes experiments/results/weight_layout.json. The Engine-level comparison
is `experiments/bench_decode.py --weight_layout=` each of in_out, out_in,
out_major, panels.
"""

from absl import flags

from benchlib import cli, flag_config, results
from benchlib.results import machine_info
from jaxinfer.engine import weight_layout

_SHAPES = flags.DEFINE_list("shapes", ["1024x5632", "2816x1024"], "d_in x d_out shapes")
_OUT = flags.DEFINE_string("out", "experiments/results/weight_layout", "output prefix (.json)")
_CONFIG = flag_config.define_config(__file__)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  rows = []
  for shape in _SHAPES.value:
    d_in, d_out = map(int, shape.split("x"))
    d_out = min(d_out, (weight_layout.PROBE_BYTES // 4) // d_in)
    probe = weight_layout.measure(d_in, d_out)
    for rows_ in weight_layout.PROBE_ROWS:
      ms = {k: v[rows_] for k, v in probe["ms"].items()}
      rows.append(dict(d_in=d_in, d_out=d_out, rows=rows_, **{f"{k}_ms": v for k, v in ms.items()},
                       **{f"{k}_speedup": ms["in_out"] / v for k, v in ms.items()},
                       chosen=probe["layout"]))
      print(f"{d_in}x{d_out} at {rows_:2d} rows: " +
            ", ".join(f"{k} {v:.2f} ms ({ms['in_out'] / v:.2f}x)" for k, v in ms.items()) +
            f"; chosen {probe['layout']}")
  results.write(_OUT.value, rows, None, machine=machine_info(),
                probe_bytes=weight_layout.PROBE_BYTES,
                note="median ms per call over copies of one weight streaming probe_bytes; "
                     "<layout>_speedup: in_out ms / <layout> ms")


if __name__ == "__main__":
  cli.run(main)
