"""Times the `pallas_kernels` against their peers and a roofline measured in the same run.

For each kernel a sweep of shapes; for each shape the kernel ("ours"), the peers
that can run here, and a float32 reference used only to check every output:

  flash   prefill, T = S: jax.nn.dot_product_attention (xla, cudnn), tokamax
          (mosaic, triton), jax's Pallas GPU `mha` (no GQA: K/V are repeated to
          N heads outside the timed call), jax's Mosaic GPU `attention_mgpu`
          ("jax_mosaic_fa3", Hopper), torch's scaled_dot_product_attention
          where torch with CUDA is installed (same inputs, through DLPack)
  paged   decode / verify over the page pool: `paged_attention_reference` (the
          XLA baseline), jax's Pallas GPU `paged_attention` (Q = 1 only)
  mla     absorbed MLA decode over the latent pool: `mla_paged_attention_reference`
  ragged  one engine step's mixed prefill-chunk + decode batch:
          `ragged_paged_attention_reference`
  qmatmul weight-only quantized matmul (fp8 / int4 / MXFP4 codes): the XLA
          form that dequantizes W and then dots, and a bf16 W dot
  gmm     the MoE grouped matmul (ragged_dot) through `ops.grouped_matmul`
          on jax's Hopper kernel `ragged_dot_mgpu`: XLA's `ragged_dot`; also
          as "ours_mosaic_experts" (`ops.mosaic_experts`, our Mosaic kernel)

The ragged step also runs as "ours_mosaic" (`mosaic_ragged_attention`, Hopper)
, "ours_mosaic_wide" (its two-warpgroup items, wide=True) and
"ours_mosaic_cluster" (those items in clusters sharing each K/V read,
cluster=True); MLA also as "ours_mosaic_cluster" (row blocks sharing each
latent read, cluster=True), "ours_mosaic_slots4" (4 latent blocks in
flight), "ours_mosaic_keys64" (64 latent rows a loop step, block_keys=64)
and "ours_mosaic_split" (each warpgroup half of S's dot, split_scores=True);
a mixed MLA step ("ragged", DeepSeek's 128 heads) on the Triton ragged kernel
("ours") and the Mosaic items ("ours_mosaic_items", clustered;
"ours_mosaic_items_plain"; "ours_mosaic_items_keys64"; "ours_mosaic_items_split").

The decode kernels also run as "ours_split": the same kernel with split-K
(`num_splits`) sized to give the GPU about two programs per SM.

Timing: every implementation is jitted, compiled and warmed up; a sample is
`inner` back-to-back calls, blocked at the end and divided by `inner` (so a
kernel shorter than a launch is not timed as launch overhead); the time is the
median of `repeats` samples. On GPU the calls rotate over enough input sets
(256 MiB in all, at most 512 sets) that repeated calls do not run out of the L2
cache. Inputs are
random normal, never zeros.

Shape sets: "default" (the full sweep), "gpu_day" (the same kernels and
peers, fewer shapes, most telling first, for a time-boxed run) and "tiny"
(a CPU smoke test). With a `deadline`, cases and implementations that would
start past it are recorded as skipped ("time box").
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import time
import zlib

import jax
import jax.numpy as jnp

from benchlib import kernel_winners
from benchlib.kernel_peers import BUILDERS, Env
from benchlib.kernel_timing import (GiB, MiB, measure_roofline, nbytes, rel_err, short_error,
                                    time_calls)

KERNELS = ("flash", "paged", "mla", "ragged", "qmatmul", "gmm")
SHAPES = ("default", "gpu_day", "tiny")
PRIMARY = {"flash": "tflops", "paged": "gbps", "mla": "gbps", "ragged": "gbps", "qmatmul": "gbps",
           "gmm": "tflops"}
CONVENTIONS = {
    "time_s": "median over `repeats` samples of (wall time of `inner` back-to-back jitted calls, "
              "block_until_ready at the end) / inner; first_call_s: the first call, compilation "
              "included unless an identical program was already compiled (the reference check)",
    "flops": "qmatmul: 2*M*N*K. flash: 4*B*T*S*N*H, halved when causal (T == S). paged/mla/ragged: "
             "2*(D + Dv)*N per (query row, visible key) pair, counted exactly (MLA: D = R + Hr, "
             "Dv = R). Every implementation is credited the same logical work.",
    "bytes": "qmatmul: codes + scales + x + out. flash: q + k + v + out, each once. paged/ragged: K and V pages actually read "
             "(ceil(length / page_size) whole pages per sequence, once per KV head) + q + out; "
             "mla: latent pages read (once for all heads) + q_latent + q_rope + out.",
    "tflops": "flops / time_s / 1e12", "gbps": "bytes / time_s / 1e9",
    "frac_peak_flops": "tflops / roofline.matmul_tflops",
    "frac_peak_bw": "gbps / roofline.hbm_gbps",
    "roofline_frac": "max(flops / peak flops, bytes / peak bandwidth) / time_s: 1 = at the roofline",
    "ours_over_peer_time": "time_s(ours) / time_s(peer): < 1 means ours is faster",
    "rel_err": "||out - ref|| / ||ref|| against the float32 reference on float32 inputs",
}
_ROTATE_BYTES, _MAX_SETS = 256 * MiB, 512  # GPU input rotation (L2 is ~50 MB)




def _metrics(case, t, roof):
  tflops, gbps = case.flops / t / 1e12, case.bytes / t / 1e9
  floor = max(tflops / roof["matmul_tflops"], gbps / roof["hbm_gbps"])
  return dict(tflops=tflops, gbps=gbps, frac_peak_flops=tflops / roof["matmul_tflops"],
              frac_peak_bw=gbps / roof["hbm_gbps"], roofline_frac=floor)


def _past(deadline, margin=0.0):
  return deadline is not None and time.monotonic() + margin > deadline


def _run_case(case, env, roof, *, warmup, repeats, deadline=None):
  """-> the case's JSON entry; an implementation's failure is recorded, never raised.
  Implementations that would start past `deadline` (time.monotonic()) are skipped."""
  key = jax.random.key(zlib.crc32(case.label.encode()))
  sets = [case.make_args(key)]
  # Rotate over enough sets that the calls, taken together, do not fit the L2 cache.
  n_sets = min(_MAX_SETS, math.ceil(_ROTATE_BYTES / max(nbytes(sets[0]), 1))) if env.gpu else 1
  sets += [case.make_args(jax.random.fold_in(key, i)) for i in range(1, n_sets)]
  entry = dict(kernel=case.kernel, label=case.label, series=case.series, context=case.context,
               shape=case.shape, flops=case.flops, bytes=case.bytes, input_sets=n_sets, impls={})

  ref, why_no_ref = None, ""
  if case.reference.temp_bytes > env.budget:
    why_no_ref = f"reference needs ~{case.reference.temp_bytes / GiB:.1f} GiB"
  else:
    # The activations / q / k / v (env.dtype) go up to float32; stored codes and scales stay.
    up = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == env.dtype else a, sets[0])
    try:
      ref = jax.block_until_ready(jax.jit(case.reference.fn)(*up)).astype(jnp.float32)
    except Exception as e:  # noqa: BLE001
      why_no_ref = f"reference failed: {short_error(e)}"
    del up
  tol = 5e-3 if jnp.dtype(env.dtype) == jnp.float32 else 2e-2
  entry.update(rel_err_tol=tol, reference_note=why_no_ref)

  for name, impl in case.impls.items():
    rec = dict(note=impl.note) if impl.note else {}
    entry["impls"][name] = rec
    if impl.skip or impl.temp_bytes > env.budget or _past(deadline):
      rec.update(status="skipped", reason=impl.skip or (
          "time box" if _past(deadline) else
          f"needs ~{impl.temp_bytes / GiB:.1f} GiB beyond its inputs"))
      continue
    try:
      args = [impl.prep(*s) for s in sets] if impl.prep else sets
      fn = impl.fn if impl.sync else jax.jit(impl.fn)
      out, first_s, inner, t = time_calls(fn, args, warmup=warmup, repeats=repeats,
                                             sync=impl.sync)
      del args
      if impl.post:
        out = impl.post(out)
    except Exception as e:  # noqa: BLE001
      rec.update(status="error", error=short_error(e))
      continue
    time_s = statistics.median(t)
    rec.update(status="ok", time_s=time_s, time_min_s=min(t), time_max_s=max(t),
               inner=inner, first_call_s=first_s, **_metrics(case, time_s, roof))
    if ref is not None:
      rec["rel_err"] = rel_err(out, ref)
      rec["numerics_ok"] = bool(rec["rel_err"] <= tol)
    del out
    if impl.sync:
      _release_torch_cache()
  ours = entry["impls"]["ours"]
  for name, rec in entry["impls"].items():
    if name != "ours" and rec.get("status") == "ok" and ours.get("status") == "ok":
      rec["ours_over_peer_time"] = ours["time_s"] / rec["time_s"]
  return entry


def _release_torch_cache():
  """Hands torch's cached blocks back to the device, so jax can use them."""
  import sys  # noqa: PLC0415
  torch = sys.modules.get("torch")
  if torch is not None and torch.cuda.is_available():
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- output


def device_slug(kind):
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def format_table(result):
  """A compact text table of a run_kernel_bench result."""
  roof = result["roofline"]
  lines = [f"device {result['meta']['device_kind']} | {result['meta']['dtype']} | interpret="
           f"{result['meta']['interpret']} | peak {roof['hbm_gbps']:.0f} GB/s, "
           f"{roof['matmul_tflops']:.1f} TFLOP/s (measured)",
           f"{'kernel':<7} {'shape':<44} {'ours ms':>9} {'ours':>13} {'roofl':>6} "
           f"{'rel_err':>8}  t_ours/t_peer (! = rel_err over tolerance)"]
  for kernel, entries in result["results"].items():
    unit = "TFLOP/s" if PRIMARY[kernel] == "tflops" else "GB/s"
    for e in entries:
      o = e["impls"]["ours"]
      if o.get("status") != "ok":
        lines.append(f"{kernel:<7} {e['label']:<44} {'ours ' + o.get('status', '?'):>9}  "
                     f"{o.get('error', o.get('reason', ''))[:60]}")
        continue
      err = f"{o['rel_err']:.1e}" if "rel_err" in o else "-"
      if o.get("numerics_ok") is False:
        err += "!"
      peers = []
      for name, r in e["impls"].items():
        if name == "ours" or r.get("status") == "skipped":
          continue
        bad = "!" if r.get("numerics_ok") is False else ""
        peers.append(f"{name} {r['ours_over_peer_time']:.2f}{bad}" if "ours_over_peer_time" in r
                     else f"{name} {r.get('status')}")
      lines.append(f"{kernel:<7} {e['label']:<44} {o['time_s'] * 1e3:>9.3f} "
                   f"{o[PRIMARY[kernel]]:>7.3g} {unit:<5} {o['roofline_frac']:>6.1%} {err:>8}  "
                   + ", ".join(peers))
  return "\n".join(lines)


def plot_panel(ax, result, kernel):
  """One kernel's throughput vs context on `ax`: colour = series, line style = impl."""
  import matplotlib.pyplot as plt  # noqa: PLC0415  (optional dependency)
  styles = ["-o", "--s", ":^", "-.v", "--D", ":x", "-.*"]
  metric, entries = PRIMARY[kernel], result["results"][kernel]
  series = list(dict.fromkeys(e["series"] for e in entries))
  names = list(dict.fromkeys(n for e in entries for n in e["impls"]))
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for si, s in enumerate(series):
    for ni, name in enumerate(names):
      pts = sorted((e["context"], e["impls"][name][metric]) for e in entries
                   if e["series"] == s and e["impls"].get(name, {}).get("status") == "ok")
      if pts:
        ax.plot(*zip(*pts), styles[ni % len(styles)], color=colours[si % len(colours)],
                label=f"{name} | {s}", markersize=4)
  peak = result["roofline"]["matmul_tflops" if metric == "tflops" else "hbm_gbps"]
  ax.axhline(peak, color="grey", lw=0.8, ls=":", label="measured peak")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("tokens M" if kernel == "qmatmul" else
                "context (keys per sequence; ragged: longest)")
  ax.set_ylabel("TFLOP/s" if metric == "tflops" else "GB/s")
  ax.set_title(kernel)
  ax.legend(fontsize=6, ncol=2)


def _plot(result, path):
  """Throughput vs context, one panel per kernel -> the path, or None when
  matplotlib is not installed."""
  try:
    import matplotlib  # noqa: PLC0415  (optional dependency)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return None
  kernels = list(result["results"])
  cols = min(2, len(kernels))
  rows = -(-len(kernels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5.5 * rows), squeeze=False)
  for ax in axes.flat[len(kernels):]:
    ax.set_visible(False)
  for ax, kernel in zip(axes.flat, kernels):
    plot_panel(ax, result, kernel)
  fig.suptitle(f"{result['meta']['device_kind']}, {result['meta']['dtype']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _check_args(kernels, shapes, repeats, warmup) -> list[str]:
  kernels = list(kernels)
  unknown = sorted(set(kernels) - set(KERNELS))
  if unknown or not kernels:
    raise ValueError(f"kernels must be a non-empty subset of {KERNELS}, got {kernels}")
  if shapes not in SHAPES:
    raise ValueError(f"shapes must be one of {SHAPES}, got {shapes!r}")
  if repeats < 1 or warmup < 0:
    raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
  return kernels


def _sweep(result: dict, env: "Env", kernels, shapes, *, warmup, repeats, save,
           deadline=None) -> None:
  """The roofline, then every case of every kernel into `result` (saved after each).
  Cases that would start past `deadline` are listed in result["skipped"]."""
  result["roofline"] = roof = measure_roofline(gpu=env.gpu, dtype=env.dtype, warmup=warmup,
                                               repeats=repeats)
  save()
  print(f"roofline: {roof['hbm_gbps']:.1f} GB/s copy, "
        f"{roof['matmul_tflops']:.2f} TFLOP/s matmul ({env.dtype.name})", flush=True)
  # Round robin over the kernels (each one's cases most telling first), so a
  # deadline cuts every kernel's tail rather than the last kernels whole.
  queues = [[(kernel, c) for c in BUILDERS[kernel](env, shapes)] for kernel in kernels]
  order = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
  for kernel, case in order:
    if _past(deadline, margin=5.0):
      result.setdefault("skipped", []).append(f"{kernel}: {case.label} (time box)")
      save()
      continue
    t0 = time.perf_counter()
    entry = _run_case(case, env, roof, warmup=warmup, repeats=repeats, deadline=deadline)
    result["results"][kernel].append(entry)
    save()
    o = entry["impls"]["ours"]
    took = f"{time.perf_counter() - t0:.1f}s"
    print(f"[{kernel}] {case.label}: " + (f"ours {o['time_s'] * 1e3:.3f} ms" if "time_s" in o
                                        else f"ours {o['status']}") + f" ({took})", flush=True)


def bench_env(*, dtype=None, interpret=None, peers=True):
  """-> (Env, device) for this process's first device: dtype None = bfloat16
  on GPU, float32 elsewhere; interpret None = True iff not on GPU."""
  dev = jax.devices()[0]
  gpu = dev.platform == "gpu"
  dtype = jnp.dtype(dtype or ("bfloat16" if gpu else "float32"))
  interpret = (not gpu) if interpret is None else bool(interpret)
  limit = (dev.memory_stats() or {}).get("bytes_limit")
  env = Env(gpu=gpu, dtype=dtype, interpret=interpret, peers=peers,
             budget=0.3 * limit if limit else 4.0 * GiB, sms=getattr(dev, "core_count", 8))
  return env, dev


def new_result(env, dev, *, kernels, shapes, repeats, warmup) -> dict:
  """The result skeleton run_kernel_bench and sweep fill."""
  return dict(
      meta=dict(device_kind=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                time=datetime.datetime.now().isoformat(timespec="seconds"),
                dtype=env.dtype.name, interpret=env.interpret, shapes=shapes,
                kernels=list(kernels), repeats=repeats, warmup=warmup, peers=env.peers,
                memory_budget_bytes=env.budget, sms=env.sms),
      conventions=CONVENTIONS, roofline={}, results={k: [] for k in kernels},
      json_path=None, plot_path=None)


def sweep(result: dict, env, *, shapes, repeats, warmup, save, deadline=None) -> dict:
  """Fills `result` (from new_result) with the roofline and every case, calling
  save() after each; cases past `deadline` (time.monotonic()) are skipped."""
  kernels = _check_args(result["results"], shapes, repeats, warmup)
  t_run = time.perf_counter()
  _sweep(result, env, kernels, shapes, warmup=warmup, repeats=repeats, save=save,
         deadline=deadline)
  result["meta"]["wall_s"] = time.perf_counter() - t_run
  save()
  return result


def plot(result, path):
  """The throughput plot of a result -> (path or None, why there is none)."""
  try:
    return _plot(result, path), "matplotlib is not installed"
  except Exception as e:  # noqa: BLE001  (the plot is optional; the JSON is already written)
    return None, f"plotting failed: {short_error(e)}"


def run_kernel_bench(*, kernels=KERNELS, shapes="default", dtype=None, interpret=None,
                     repeats=20, warmup=3, peers=True, out_dir="experiments/results"):
  """Runs the sweep, prints progress and a table, writes JSON (+ PNG) -> the result dict.

  Files: <out_dir>/kernel_bench_<device kind>_<YYYY-MM-DD>[_<kernels>].json and
  .png (the kernels are named only for a subset; a rerun on the same day overwrites).

  dtype: None = bfloat16 on GPU, float32 elsewhere. interpret: None = True iff
  not on GPU. The JSON is rewritten after every case, so a run cut short keeps
  what it measured. Paths land in result["json_path"] / result["plot_path"].
  """
  kernels = _check_args(kernels, shapes, repeats, warmup)
  env, dev = bench_env(dtype=dtype, interpret=interpret, peers=peers)
  os.makedirs(out_dir, exist_ok=True)
  # A run over a subset of the kernels names them, so it does not overwrite a full run.
  subset = "" if set(kernels) == set(KERNELS) else "_" + "-".join(kernels)
  base = os.path.join(out_dir, f"kernel_bench_{device_slug(dev.device_kind)}_"
                               f"{datetime.date.today():%Y-%m-%d}{subset}")
  result = new_result(env, dev, kernels=kernels, shapes=shapes, repeats=repeats, warmup=warmup)
  result["json_path"] = base + ".json"

  def save():
    with open(result["json_path"], "w") as f:
      json.dump(result, f, indent=1)

  sweep(result, env, shapes=shapes, repeats=repeats, warmup=warmup, save=save)
  result["plot_path"], why_no_plot = plot(result, base + ".png")
  save()
  winners = kernel_winners.winner_table(result)
  winners_json = kernel_winners.winners_path(result["json_path"])
  with open(winners_json, "w") as f:
    json.dump(winners, f, indent=1)
  print("\n" + format_table(result))
  print("\n" + kernel_winners.format_winners(winners))
  print(f"\nwrote {result['json_path']}, {winners_json}" + (
      f" and {result['plot_path']}" if result["plot_path"] else f" (no plot: {why_no_plot})"))
  return result


def list_candidates(*, kernels=KERNELS, shapes="default", dtype=None, peers=True) -> dict:
  """`kernel_bench --dry_run`: every case and its candidates on this
  process's device, nothing compiled or timed (`kernel_winners.candidates`);
  prints them and returns the listing."""
  kernels = _check_args(kernels, shapes, 1, 0)
  env, _ = bench_env(dtype=dtype, peers=peers)
  listing = kernel_winners.candidates(kernels, shapes, env)
  print(kernel_winners.format_candidates(listing))
  return listing
