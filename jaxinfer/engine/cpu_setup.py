"""The CPU engine's one-time setup, run when asked, never inside `Engine(...)`:

  python -m jaxinfer.engine.cpu_setup [preset ...]   # default: PROBED_PRESETS

builds the C++ CPU kernels for this machine (`native_kernels.build`;
they build on first use otherwise) and probes the float weight layouts at
each preset's widest projection (`weight_layout.probe`), keeping the result
beside the kernels' library, where `EngineConfig(cpu_weight_layout="auto")`
reads it.
"""

from __future__ import annotations

import sys

from jaxinfer import ops, presets
from jaxinfer.engine import weight_layout

PROBED_PRESETS = ("bench_dense", "bench_moe")


def main(names: list[str]) -> int:
  """Builds the kernels, probes each preset (PROBED_PRESETS without names),
  prints what it found. -> exit status: 0, or 1 where the kernels did not
  build (the probe then times the XLA layouts only)."""
  built = ops.cpu_kernels.build()
  print(f"C++ CPU kernels: {ops.cpu_kernels.status()} ({ops.cpu_kernels.library_path()})")
  for name in names or PROBED_PRESETS:
    cfg = presets.get(name)
    result = weight_layout.probe(cfg)
    layout = result["layout"] if result else "in_out (too small to time)"
    print(f"{name} {weight_layout.probe_shape(cfg)}: {layout} -> {weight_layout.probe_path()}")
  return 0 if built else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
