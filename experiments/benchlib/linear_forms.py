"""How XLA:CPU multiplies a few rows by a projection weight: a dot against a
multiply-reduce fusion (`layers.row_reduce_matmul`), for float32 weights and
weight-only quantized ones (dequantize-then-dot against the reduce that
reads the codes once).

The measured program is a stack of gated MLPs at `bench_dense`'s shapes
(1024 -> 2 x 2816 -> 1024, 8 layers, 277 MB of float32 weights), so the
weights stream from memory as in a decode step. Each (weights, form) is
timed at each row count, the forms interleaved, median of the repeats.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchlib.decode import quantized
import jaxinfer
from jaxinfer import models
from jaxinfer.models import layers, quant

D, F, LAYERS = 1024, 2816, 8
BLOCKS = {"int4": (1, 32), "mxfp4": (1, 32), "nvfp4": (1, 16),  # as bench_decode; else per channel
          "fp8_block128": (128, 128)}  # DeepSeek-V3's fp8 checkpoints


def _weights(kind: str, rng) -> list:
  """[(gate_up [2F, D], down [D, F])] per layer as PackedLinear or QuantizedWeight."""
  out = []
  for _ in range(LAYERS):
    pair = []
    for d_in, d_out in ((D, 2 * F), (F, D)):
      w = rng.standard_normal((d_in, d_out), dtype=np.float32) / np.sqrt(d_in)
      if kind == "float32":
        pair.append(layers.pack_linear(jnp.asarray(w)))
      else:
        method = kind.split("_")[0]
        pair.append(jax.device_put(quant.quantize(w, method, BLOCKS.get(kind, (1, 0)))))
    out.append(tuple(pair))
  return out


def _is_weight(w) -> bool:
  return isinstance(w, (layers.PackedLinear, quant.QuantizedWeight))


def _dot(x, w):
  wt = quant.matmul_weight(w, jnp.float32) if isinstance(w, quant.QuantizedWeight) else w.wt
  return jnp.einsum("mi,oi->mo", x, wt)


FORMS = {"dot": _dot, "row_reduce": layers.row_reduce_matmul}
# The dot reads the weights as loaded (quantized: dequantized whole, as the
# engine's CPU step did before the reduce); the reduce reads the CPU step
# layout (`layers.pack_linear`: 4-bit and fp8 codes unpacked).
LAYOUT = {"dot": lambda w: w, "row_reduce": lambda w: (layers.pack_linear(w) if isinstance(
    w, quant.QuantizedWeight) else w)}


def _program(form: str):
  mul = FORMS[form]

  def mlps(x, weights):
    for gate_up, down in weights:
      h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
      g, u = jnp.split(mul(h, gate_up), 2, axis=-1)
      x = x + mul(jax.nn.silu(g) * u, down)
    return x
  return jax.jit(mlps)


def measure(kinds=("float32", "int8", "fp8", "int4"), rows=(1, 2, 4, 8, 16, 32, 64, 128, 512),
            repeats: int = 5, seed: int = 0) -> list[dict]:
  """-> one row per (weights, rows, form): median ms, min ms, GB/s of weight
  bytes, and `vs_float_dot` (the float32 dot's time over this one)."""
  rng = np.random.default_rng(seed)
  programs = {f: _program(f) for f in FORMS}
  loaded = {k: _weights(k, rng) for k in kinds}
  weights = {(k, f): jax.tree.map(LAYOUT[f], loaded[k], is_leaf=_is_weight)
             for k in kinds for f in FORMS}
  out = []
  for m in rows:
    x = jnp.asarray(rng.standard_normal((m, D), dtype=np.float32))
    cells = [(k, f) for k in kinds for f in FORMS]
    ref = {}
    for k, f in cells:  # compile, and check the forms agree
      ref[k, f] = np.asarray(programs[f](x, weights[k, f]))
    for k in kinds:
      scale = np.abs(ref[k, "dot"]).max()
      np.testing.assert_allclose(ref[k, "row_reduce"], ref[k, "dot"], rtol=0, atol=1e-4 * scale)
    times = {c: [] for c in cells}
    for _ in range(repeats):
      for k, f in cells:
        t = time.perf_counter()
        programs[f](x, weights[k, f]).block_until_ready()
        times[k, f].append(time.perf_counter() - t)
    float_dot = np.median(times.get(("float32", "dot"), [np.nan]))
    for (k, f), ts in times.items():
      med = float(np.median(ts))
      out.append(dict(weights=k, rows=m, form=f, ms=1e3 * med, ms_min=1e3 * min(ts),
                      weight_gbps=quant.nbytes(weights[k, f]) / med / 1e9,
                      vs_float_dot=float(float_dot / med)))
      print(f"{k:8s} rows {m:4d} {f:10s} {1e3 * med:8.2f} ms  x{float_dot / med:.2f} of the "
            f"float32 dot", flush=True)
  return out


def best_ranges(rows: list[dict]) -> dict:
  """Per weights kind, the row counts where the reduce beat the dot."""
  by = {}
  for r in rows:
    by.setdefault(r["weights"], {}).setdefault(r["rows"], {})[r["form"]] = r["ms"]
  return {k: [m for m, f in sorted(v.items()) if f["row_reduce"] < f["dot"]] for k, v in by.items()}


# ------------------------------------------------------------ in the engine

ROW_SETTINGS = {"dot": {"float": (0, 0), "quantized": (0, 0)},
                "reduce": {"float": (1, 64), "quantized": (1, 64)}}


def engine_decode_ms(weights: str, batch: int, setting: str, *, model: str = "bench_dense",
                     prompt_len: int = 32, steps: int = 8, repeats: int = 3) -> float:
  """Median decode step (ms) of an unrolled Engine on `model` (weights
  "float32" or a quant method, per channel) at `batch` sequences, with
  `layers.ROW_REDUCE_ROWS` set to ROW_SETTINGS[setting] ("default": as it
  is). One setting per process: the step programs are cached by shape, so a
  second setting in the same process would reuse the first one's."""
  if setting != "default":
    layers.ROW_REDUCE_ROWS.update(ROW_SETTINGS[setting])
  cfg = jaxinfer.presets.get(model)
  params = models.init_params(cfg, jax.random.key(0))
  if weights != "float32":
    cfg, params = quantized(cfg, params, weights)
  engine = jaxinfer.Engine(cfg, params, jaxinfer.EngineConfig(
      max_num_seqs=batch, page_size=16, num_pages=batch * (prompt_len + steps + 16) // 16 + 8,
      unroll_layers=True))
  del params
  prompts = [list(range(5, 5 + prompt_len))] * batch
  run = lambda n: engine.generate(prompts, jaxinfer.SamplingParams(max_tokens=n, temperature=0.0))
  run(3)  # compiles the prefill and decode programs
  per_step = []
  for _ in range(repeats):  # decode time: (n + 1 tokens) - (1 token), per step
    t = time.perf_counter()
    run(1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    run(steps + 1)
    per_step.append((time.perf_counter() - t - t1) / steps)
  return 1e3 * float(np.median(per_step))
