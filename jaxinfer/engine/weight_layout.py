"""Which way round the unsharded CPU step holds and multiplies float
projection weights: [In, Out] as loaded ("in_out"), or transposed, [Out, In]
(`layers.PackedLinear`), multiplied as rows x w^T ("out_in") or as w x rows^T
into [Out, rows] ("out_major", `layers.out_major_dot`), or float32 ones
packed in 32-column panels for the C++ CPU kernel ("panels",
`ops.panel_linear`, offered where that kernel builds). XLA:CPU's matmul
speed for them differs by machine, and not by a little:

  2-core Intel Xeon (earlier benchmark rounds): "out_in" 1.1x faster at 1 row,
    1.45x at 8, 1.4x at 32 (bench_dense's projections).
  2-core AMD EPYC (experiments/results/weight_layout.json): "in_out" 1.1x
    at 1 row, 1.54x at 8, 1.38x at 32 on bench_dense's gate-up (the down
    projection: 0.80x / 1.39x / 1.20x); the Engine's bench_dense decode ran
    1.12x / 1.23x / 1.24x faster with it at batch 1 / 8 / 32 and prefill
    0.99x (results/bench_decode_bench_dense_{in_out,out_in}.json).

  2-core AMD EPYC, later: "out_major" against "in_out", the Engine's
    bench_dense decode step 1.55x faster at batch 8 (29.4 against 45.6 ms),
    1.26x at 1, 1.17x at 32; the probe's gate-up 1.27x / 1.40x / 1.15x at
    1 / 8 / 32 rows (results/weight_layout.json).

  2-core AMD EPYC (Zen 5), benchmark round 33: "panels" against "out_major" on
    bench_dense's shapes 1.2-1.5x at 8 rows (41-43 GB/s against 28-32),
    1.0-1.3x at 32 in one probe, 0.86-1.28x in the next (the down
    projection, 2816 deep, the slower one), 1.0-1.08x at 512
    (results/weight_layout.json, the second probe).

So they are timed on the machine (`probe`: all of them, at a model's widest
projection, "panels" where the C++ kernels build), explicitly:

  python -m jaxinfer.engine.cpu_setup [preset ...]   # default: bench_dense bench_moe

which builds the C++ kernels, times, and keeps the result on disk beside
the kernels' library (`probe_path`: the same key, so a probe of another
CPU, compiler or jax is never read). `EngineConfig.cpu_weight_layout="auto"`
reads it and times nothing: the probed layout fastest over PROBE_ROWS for
the model's projection ("panels" only where the kernels may run here), or
UNPROBED where no probe of that shape is on disk: "out_major", 1.17-1.55x
"in_out" in the Engine's decode on the EPYC above, and needing no kernel
build ("panels" was faster on the Zen 5, once built).

`choose` makes the whole choice once, when an Engine loads its weights:
scanned stacked layers, or unrolled per-layer weights in one
`layouts.WeightForm` (experts split, projections transposed, which way the
float ones sit), which the Engine keeps.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import out_major_dot
from jaxinfer.models.layouts import WeightForm

LAYOUTS = ("auto", "in_out", "out_in", "out_major", "panels")
# EngineConfig.unroll_layers=None: unroll on the CPU backend from this many
# layer weight bytes, where the scan's per-step weight copies dominate a
# step; smaller models keep the scan's faster compile.
UNROLL_MIN_BYTES = 64 << 20
# Below this many weight bytes per projection the choice cannot matter
# (the weights sit in cache): "in_out", with no timing.
MIN_PROBE_BYTES = 4 << 20
# The probe streams this many bytes of weights (copies of one projection), so
# they come from memory as a step's do, not from cache.
PROBE_BYTES = 96 << 20
PROBE_ROWS = (1, 8, 32)
UNPROBED = "out_major"  # "auto" where no probe of the shape is on disk


def choose(cfg: ModelConfig, config, params, mesh=None, *, expert_parallel: bool = False,
           backend: str | None = None) -> WeightForm | None:
  """The weight form of an Engine's steps, chosen once at load (config: its
  `EngineConfig`; params: the stacked weights as placed; backend: jax's
  default backend unless given): None to scan the stacked layers, else the
  unrolled steps' `WeightForm`. On a GPU the default (unroll_layers None)
  unrolls, into per-layer arrays [In, Out] as loaded with q, k and v fused
  by KV head (`WeightForm(fused_qkv=True)`; gate and up fused, MLA
  absorbed, each layer's experts stacked for the grouped kernels): the
  compiled step then reads every weight in place, where the scanned one
  copies each layer's weights out of the stack (`benchlib.hlo_report`:
  13.96 GB a step for llama3_8b on jax 0.10.2, 1.61 GB on 0.12.1). On the
  CPU the default unrolls from UNROLL_MIN_BYTES of layer weights: experts split unless expert-parallel (and open
  to the C++ CPU kernel when unsharded), projections transposed when
  unsharded, float ones as `resolve` picks for this machine."""
  backend = backend or jax.default_backend()
  unroll = config.unroll_layers
  if unroll is None:
    layer_bytes = sum(w.nbytes for w in jax.tree.leaves(params["layers"]))
    unroll = backend != "cpu" or layer_bytes >= UNROLL_MIN_BYTES
  if not unroll:
    return None
  if backend != "cpu":
    return WeightForm(fused_qkv=True)
  layout = resolve(cfg, config.cpu_weight_layout, mesh)
  return WeightForm(split_experts=not expert_parallel, transposed=mesh is None,
                    native_experts=not expert_parallel and mesh is None,
                    floats_in_out=layout == "in_out", out_major=layout == "out_major",
                    panels=layout == "panels" and cfg.compute_dtype() == jnp.float32)


def resolve(cfg: ModelConfig, layout: str, mesh=None) -> str:
  """EngineConfig.cpu_weight_layout -> one of LAYOUTS but "auto" for this
  model and machine, timing and building nothing ("auto": the probe on
  disk for the widest dense projection, d_model x 2 ffn_dim, the fused
  gate-up, `probed_layout`; "in_out" below MIN_PROBE_BYTES). With a mesh
  the sharded step keeps the loaded layout whatever this returns. "panels"
  needs the C++ CPU kernels: a ValueError where they cannot run here, as
  far as is known without building them (`native_kernels.precheck`)."""
  if layout not in LAYOUTS:
    raise ValueError(f"cpu_weight_layout must be one of {LAYOUTS}, got {layout!r}")
  if layout == "panels" and _panels_unavailable():
    raise ValueError("cpu_weight_layout='panels' needs the C++ CPU kernels: "
                     f"{_panels_unavailable()}")
  if layout != "auto":
    return layout
  if mesh is not None:
    return "out_in"  # unused (see above)
  d_in, d_out = probe_shape(cfg)
  if d_in * d_out * 4 < MIN_PROBE_BYTES:
    return "in_out"
  return probed_layout(d_in, d_out)


def probe_shape(cfg: ModelConfig) -> tuple[int, int]:
  """The projection "auto" is probed at: d_model x 2 ffn_dim (the fused
  gate-up, dense or expert), its width capped to PROBE_BYTES of float32."""
  d_in, d_out = cfg.d_model, 2 * max(cfg.ffn_dim, cfg.moe_ffn_dim or 0)
  return d_in, min(d_out, max(1, (PROBE_BYTES // 4) // d_in))


def probe_path() -> Path:
  """The probes on disk: beside the C++ kernels' library, under its key
  (sources, flags, jax version, CPU, compiler)."""
  return ops.cpu_kernels.library_path().with_suffix(".layouts.json")


def _read_probes() -> dict:
  try:
    return json.loads(probe_path().read_text())
  except (OSError, ValueError):
    return {}


def probed_layout(d_in: int, d_out: int) -> str:
  """"auto"'s layout for a [d_in, d_out] projection: of the probe on disk
  (`probe`), the fastest by geometric mean over PROBE_ROWS, "panels" left
  out where the C++ kernels cannot run; UNPROBED without one."""
  ms = _read_probes().get(f"{d_in}x{d_out}", {}).get("ms")
  if not ms:
    return UNPROBED
  usable = {k: v for k, v in ms.items()
            if k in LAYOUTS and (k != "panels" or not _panels_unavailable())}
  score = {k: float(np.exp(np.mean(np.log(list(v.values()))))) for k, v in usable.items()}
  return min(score, key=score.get) if score else UNPROBED


def probe(cfg: ModelConfig) -> dict | None:
  """Builds the C++ CPU kernels (so "panels" is timed where they build),
  times the layouts at the model's `probe_shape` (`measure`) and writes the
  result to `probe_path()` for "auto" to read. -> the `measure` result, or
  None for a projection under MIN_PROBE_BYTES (nothing timed: "in_out")."""
  ops.cpu_kernels.build()
  d_in, d_out = probe_shape(cfg)
  if d_in * d_out * 4 < MIN_PROBE_BYTES:
    return None
  result = measure(d_in, d_out)
  path = probe_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  probes = {**_read_probes(), f"{d_in}x{d_out}": result}
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(probes, indent=1))
  tmp.replace(path)
  return result


@functools.cache
def measure(d_in: int, d_out: int, repeats: int = 7) -> dict:
  """Times x [rows, d_in] times float32 weights [d_in, d_out] in each
  layout (copies streaming PROBE_BYTES), at each of PROBE_ROWS rows, the
  layouts interleaved -> {layout: the one with the smallest geometric mean
  over the row counts, ms: {layout: {rows: median ms}}}. Cached per
  process."""
  copies = max(1, PROBE_BYTES // (4 * d_in * d_out))
  rng = np.random.default_rng(0)
  w = [rng.standard_normal((d_in, d_out), dtype=np.float32) for _ in range(copies)]
  held = {"in_out": [jnp.asarray(a) for a in w], "out_in": [jnp.asarray(a.T) for a in w]}
  held["out_major"] = held["out_in"]
  forms = {"in_out": jax.jit(lambda x, ws: [x @ a for a in ws]),
           "out_in": jax.jit(lambda x, ws: [jnp.einsum("mi,oi->mo", x, a) for a in ws]),
           "out_major": jax.jit(lambda x, ws: [out_major_dot(x, a) for a in ws])}
  if _panels_available():
    held["panels"] = [ops.pack_panels(a) for a in held["in_out"]]
    forms["panels"] = jax.jit(lambda x, ws: [ops.panel_linear(x, a, d_out) for a in ws])
  ms = {k: {} for k in forms}
  for rows in PROBE_ROWS:
    x = jnp.ones((rows, d_in), jnp.float32)
    times = {k: [] for k in forms}
    for rep in range(repeats + 1):
      for k, f in forms.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, held[k]))
        if rep:  # the first call compiles
          times[k].append(time.perf_counter() - t0)
    for k in forms:
      ms[k][rows] = 1e3 * statistics.median(times[k])
  score = {k: float(np.exp(np.mean(np.log(list(ms[k].values()))))) for k in forms}
  return dict(layout=min(score, key=score.get), ms=ms)


def _panels_available() -> bool:
  """Whether `measure` times "panels": the CPU backend, the C++ kernels
  built (building them: `measure` is the explicit probe)."""
  return jax.default_backend() == "cpu" and ops.cpu_kernels.available()


def _panels_unavailable() -> str | None:
  """Why "panels" cannot run here, building nothing: not the CPU backend,
  or the C++ kernels' `precheck`; None where it may."""
  if jax.default_backend() != "cpu":
    return f"the {jax.default_backend()} backend"
  return ops.cpu_kernels.precheck()

