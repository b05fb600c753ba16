"""Tunes the Mosaic GPU paged decode kernel on a GPU: blocks in flight
(`slots`) x keys per loop step (`block_keys`) x split-K ways, at decode
shapes, each timed as kernel_bench times kernels, against the copy bandwidth
measured in the same run, and checked against the float32 reference.

  PYTHONPATH=. python3 experiments/mosaic_tune.py --out=/tmp/mosaic_tune.json
  PYTHONPATH=. python3 experiments/mosaic_tune.py --dry_run --out=/tmp/t.json  # CPU, interpreted

Writes one JSON: the roofline, and per shape every variant's time, GB/s,
fraction of the copy bandwidth and error (or why it did not run).
"""

import json
import statistics
import types

from absl import flags
import jax
import jax.numpy as jnp

from benchlib import cli, flag_config, kernel_peers, kernel_timing
import pallas_kernels as pk
from pallas_kernels import mosaic_paged_attention as mpa

_OUT = flags.DEFINE_string("out", "/tmp/mosaic_tune.json", "the JSON written")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "CPU: tiny shapes, interpret mode")
_REPEATS = flags.DEFINE_integer("repeats", 10, "timed samples per variant")
_CONFIG = flag_config.define_config(__file__)

SHAPES = [dict(B=8, S=8192, ps=16), dict(B=64, S=8192, ps=16), dict(B=1, S=32768, ps=64),
          dict(B=64, S=1024, ps=64), dict(B=8, S=8192, ps=64)]  # N 32 / K 8 / D 128
VARIANTS = [dict(slots=s, block_keys=k) for k in (64, 128) for s in (2, 3, 4)]


def inputs(B, S, ps, N, K, D, dtype, key):
  kq, kk, kv, kt = jax.random.split(key, 4)
  tables, P = kernel_peers.page_tables(kt, [S] * B, ps)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
  return (normal(kq, (B, N, D)), normal(kk, (K, P, ps, D)), normal(kv, (K, P, ps, D)),
          jnp.full((B,), S, jnp.int32), tables)


def tune_shape(shape, *, N, K, D, dtype, interpret, repeats, roof, variants=VARIANTS) -> dict:
  B, S, ps = shape["B"], shape["S"], shape["ps"]
  args = inputs(B, S, ps, N, K, D, dtype, jax.random.key(B * S + ps))
  f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
  ref = pk.paged_attention_reference(*f32)
  nbytes = jnp.dtype(dtype).itemsize * (B * S * K * 2 * D + B * N * 2 * D)
  rows = {}
  for v in variants:
    h100 = types.SimpleNamespace(sms=132)  # split-K to ~2 programs per SM, as kernel_bench
    for splits in sorted({1, kernel_peers.split_count(h100, B * K, S // max(ps, v["block_keys"]))}):
      name = f"slots{v['slots']}_keys{v['block_keys']}_splits{splits}"
      bad = mpa.unsupported((B, 1, N, D), dtype, args[1].shape, values_dim=D, **v)
      if bad:
        rows[name] = dict(status="skipped", why=bad[1])
        continue
      fn = jax.jit(lambda *a, v=v, splits=splits: mpa.mosaic_paged_attention(
          *a, num_splits=splits, interpret=interpret, **v))
      try:
        out, first_s, inner, t = kernel_timing.time_calls(
            fn, [args], warmup=0 if interpret else 2, repeats=repeats)
      except Exception as e:  # noqa: BLE001  (recorded; the next variant runs)
        rows[name] = dict(status="error", error=kernel_timing.short_error(e))
        continue
      sec = statistics.median(t)
      rows[name] = dict(status="ok", time_s=sec, gbps=nbytes / sec / 1e9,
                        frac_copy_bw=nbytes / sec / 1e9 / roof["hbm_gbps"],
                        rel_err=kernel_timing.rel_err(out, ref), first_call_s=first_s, inner=inner)
  return dict(shape=dict(shape, N=N, K=K, D=D), bytes=nbytes, variants=rows)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  dry = _DRY_RUN.value
  why = mpa.available()
  if why:
    raise SystemExit(f"mosaic_tune: {why}")
  dtype = jnp.bfloat16
  gpu = jax.default_backend() == "gpu"
  roof = kernel_timing.measure_roofline(gpu=gpu, dtype=dtype, warmup=2, repeats=5)
  shapes, dims, variants = SHAPES, dict(N=32, K=8, D=128), VARIANTS
  if dry:
    shapes, dims = [dict(B=2, S=128, ps=16)], dict(N=8, K=2, D=64)
    variants = [dict(slots=2, block_keys=64), dict(slots=2, block_keys=128)]
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, roofline=roof,
                dry_run=dry, cases=[])
  for shape in shapes:
    case = tune_shape(shape, dtype=dtype, interpret=dry, repeats=1 if dry else _REPEATS.value,
                      roof=roof, variants=variants, **dims)
    result["cases"].append(case)
    ok = {k: v for k, v in case["variants"].items() if v["status"] == "ok"}
    best = max(ok, key=lambda k: ok[k]["gbps"]) if ok else None
    print(f"{shape}: best {best} "
          + (f"{ok[best]['gbps']:.0f} GB/s ({100 * ok[best]['frac_copy_bw']:.0f}% of copy)"
             if best else "none ran"), flush=True)
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
