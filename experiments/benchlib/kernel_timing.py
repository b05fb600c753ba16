"""Timing a jitted call and the roofline it is measured against (the kernel
benchmarks' clock, `benchlib.kernels`, `mosaic_tune.py`, the GPU day).

  time_calls(fn, arg_sets, warmup=, repeats=)   -> (first output, first call s, inner, samples s)
  rel_err(out, ref)                              ||out - ref|| / ||ref|| in float32
  measure_roofline(gpu=, dtype=, ...)            peak copy bandwidth and matmul rate, here
  short_error(e)                                 an exception as one line

A sample is `inner` back-to-back calls, blocked at the end and divided by
`inner`, so a call shorter than a launch is not timed as launch overhead.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp

from benchlib.kernel_case import normal as _normal, short_error  # noqa: F401 (kernel_timing's own)

MiB, GiB = 1 << 20, 1 << 30
_TARGET_SAMPLE_S = 0.01  # one timing sample lasts about this long
_MAX_INNER = 64


def nbytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def block(out, sync=None):
  """Waits for `out` (jax arrays, or a peer's outputs through its `sync`)."""
  if sync is None:
    return jax.block_until_ready(out)
  sync(out)
  return out


def time_calls(fn, arg_sets, *, warmup, repeats, sync=None):
  """-> (first output, first_call_s, inner, per-call samples in seconds)."""
  n = len(arg_sets)
  t0 = time.perf_counter()
  first = block(fn(*arg_sets[0]), sync)
  first_s = time.perf_counter() - t0
  for i in range(warmup):
    block(fn(*arg_sets[(i + 1) % n]), sync)
  t0 = time.perf_counter()
  block(fn(*arg_sets[1 % n]), sync)
  one = time.perf_counter() - t0
  inner = max(1, min(_MAX_INNER, math.ceil(_TARGET_SAMPLE_S / max(one, 1e-7))))
  keep_all = sync is None and inner * nbytes(first) <= 256 * MiB  # else block on the last
  samples = []
  for r in range(repeats):
    outs = []
    t0 = time.perf_counter()
    for i in range(inner):
      out = fn(*arg_sets[(r * inner + i) % n])
      outs = outs + [out] if keep_all else [out]
    block(outs, sync)
    samples.append((time.perf_counter() - t0) / inner)
  return first, first_s, inner, samples


def rel_err(out, ref):
  out = jnp.asarray(out, jnp.float32)
  if not bool(jnp.all(jnp.isfinite(out))):
    return float("nan")
  return float(jnp.linalg.norm((out - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def measure_roofline(*, gpu, dtype, warmup, repeats):
  """Peak bandwidth (device copy: bytes read + written) and matmul rate, measured here."""
  dtype = jnp.dtype(dtype)
  n = (2 * GiB if gpu else 64 * MiB) // dtype.itemsize
  x = jax.random.uniform(jax.random.key(1), (n,), jnp.float32, 1.0, 2.0).astype(dtype)
  copy = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
  _, _, _, t = time_calls(copy, [(x,)], warmup=warmup, repeats=max(repeats, 5))
  copy_s = statistics.median(t)
  del x
  m = 8192 if gpu else 1024
  ka, kb = jax.random.split(jax.random.key(2))
  a, b = _normal(ka, (m, m), dtype), _normal(kb, (m, m), dtype)
  _, _, _, t = time_calls(jax.jit(jnp.matmul), [(a, b)], warmup=warmup, repeats=max(repeats, 5))
  mm_s = statistics.median(t)
  return dict(hbm_gbps=2 * n * dtype.itemsize / copy_s / 1e9, copy_bytes=2 * n * dtype.itemsize,
              copy_time_s=copy_s, matmul_tflops=2.0 * m ** 3 / mm_s / 1e12, matmul_m=m,
              matmul_dtype=dtype.name, matmul_time_s=mm_s,
              method="copy: jit(x + 1) over a 1-D array, bytes = read + written; matmul: "
                     "jit(a @ b) of two random [M, M] arrays at default precision; medians "
                     "as for the kernels")


