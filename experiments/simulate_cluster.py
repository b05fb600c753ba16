"""Cluster simulator: the engine's scheduler and the serving router over
simulated workers (`jaxinfer/sim/`).

  python experiments/simulate_cluster.py --mode=calibrate_check   # fit on this machine, check 2 workloads
  python experiments/simulate_cluster.py --mode=scale             # DeepSeek-R1 on 8..288 GPUs
  python experiments/simulate_cluster.py --mode=scale --experiments=pareto --pareto_device=b200 --pareto_gpus=16
  python experiments/simulate_cluster.py --mode=mlperf          # MLPerf GB300 table + ablation

calibrate_check  measures the real engine's step times on this machine
                 (one worker, synchronous steps, fixed step shapes), fits a
                 CalibratedCost, then serves an Offline-style burst and
                 Poisson multi-turn conversations for real and in the
                 simulator: predicted vs measured tokens/s and mean TTFT.
scale            roofline step times of --sim_model on the device table:
                 anchors, EP sizes per device, the co-located vs
                 disaggregated x MTP Pareto (tokens/s/GPU vs p99 TPOT, best
                 under the DeepSeek-R1 Interactive and Server limits, $/M
                 tokens), KV-aware vs round-robin routing, attention-DP
                 rank balance. Every assumption is in jaxinfer/sim/cost.py and
                 experiments/benchlib/sim_scale.py.
mlperf           DeepSeek-R1 and Llama 3.1 405B MLPerf scenarios (Offline,
                 Server, Interactive) on GB300, each on the system of the
                 submission that published it (8 or 72 GPUs): the best
                 configuration per scenario under MLPerf's limits and the
                 model at the record's own deployment, predicted vs
                 published tokens/s per GPU for v5.1 and v6.0, and the
                 v5.1 -> v6.0 ablation (jaxinfer/sim/mlperf.py,
                 experiments/benchlib/sim_mlperf.py).
Results: a table on stdout, JSON and a plot under experiments/results/.
"""

from __future__ import annotations

import json
import os

from absl import flags

from benchlib import (cli, flag_config, model_flags, results, sim_calibration, sim_mlperf,
                      sim_scale)
from jaxinfer.sim.engine import TRTLLM_R1_ACCEPTANCE

RESULTS = os.path.join(os.path.dirname(__file__), "results")

_MODE = flags.DEFINE_enum("mode", "scale", ["calibrate_check", "scale", "mlperf"], "what to run")
_OUT = flags.DEFINE_string("out", "", "output prefix (default results/sim_calibration, "
                           "results/sim_scale or results/mlperf_sim)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of workloads and MTP acceptance draws")
# calibrate_check
_MODEL = model_flags.define(default="tiny_dense")  # calibrate_check: float32 unless default
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 8, "calibrate_check: engine sequences")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 32, "calibrate_check: token budget")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 512, "calibrate_check: KV pages")
_TOLERANCE = flags.DEFINE_float("tolerance", 0.25, "calibrate_check: allowed relative error")
_ROUNDS_CHECK = flags.DEFINE_integer("check_rounds", 3, "calibrate_check: rounds of calibrate, "
                                     "serve both workloads (judged by the median ratio)")
# scale
_SIM_MODEL = flags.DEFINE_string("sim_model", "deepseek_v3", "scale: preset simulated")
_DEVICES = flags.DEFINE_list("devices", ["gb300", "b200", "h200", "h100"], "scale: ep table")
_GPUS = flags.DEFINE_list("gpus", ["8", "16", "32", "72", "144", "288"], "scale: ep table sizes")
_PARETO_DEVICE = flags.DEFINE_string("pareto_device", "gb300", "scale: pareto/routing device")
_PARETO_GPUS = flags.DEFINE_integer("pareto_gpus", 72, "scale: GPUs of the pareto cluster")
_ISL = flags.DEFINE_integer("isl", 1024, "scale: mean prompt tokens (uniform +-50%)")
_OSL = flags.DEFINE_integer("osl", 1024, "scale: mean output tokens (uniform +-50%)")
_WEIGHT_DTYPE = flags.DEFINE_enum("weight_dtype", "auto", ["auto", "bf16", "fp8", "fp4"],
                                  "scale: auto = fp4 on Blackwell, fp8 on Hopper")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", "bf16", ["bf16", "fp8"], "scale: K/V cache dtype")
# The largest is the decode batch cap per GPU (ASSUMED: deployments cap the
# CUDA-graph batch at a few hundred); a limit not reached below it reports
# the point at the cap.
_CONCURRENCY = flags.DEFINE_list("concurrency", ["8", "16", "32", "64", "128", "192", "256"],
                                 "scale: requests in flight per decode rank (closed loop)")
_MTP = flags.DEFINE_list("mtp", ["0", "1", "2", "3"], "scale: co-located MTP drafts K")
_DISAGG_MTP = flags.DEFINE_list("disagg_mtp", ["0", "3"], "scale: disaggregated MTP drafts K")
_COLO_BUDGETS = flags.DEFINE_list("colo_budgets", ["512", "2048"],
                                  "scale: co-located token budgets per step (prefill chunk); "
                                  "the first runs every --mtp K, the others K = 0 and the largest")
_SPLITS = flags.DEFINE_list("disagg_splits", ["1:1", "1:2"],
                            "scale: simulated prefill:decode ranks (the GPU split)")
_PREFILL_EP = flags.DEFINE_integer("prefill_ep", 8, "scale: EP size of prefill instances")
_ACCEPTANCE = flags.DEFINE_string(
    "acceptance", "trtllm", "scale: MTP acceptance P(accepted > j): 'trtllm' (DeepSeek-R1, "
    "TensorRT-LLM's lengths 1.92/2.58/2.82), 'measured' (our default model, "
    "results/bench_speculative.json), or comma floats")
_EXTRA_ACCEPTANCE = flags.DEFINE_bool(
    "compare_measured_acceptance", True, "scale: add a co-located curve at the largest K with "
    "the acceptance measured on our default model")
# Assumed: a GPU-hour of an H100-class cloud GPU; the seeds quote $0.30/M
# tokens for DeepSeek-R1 Interactive, whose price per GPU-hour is not given.
_PRICE = flags.DEFINE_float("price_per_gpu_hour", 3.0, "scale: $ per GPU-hour")
_ROUNDS = flags.DEFINE_float("rounds", 2.0, "scale: requests per point = rounds x concurrency")
_ROUTING_GPUS = flags.DEFINE_integer("routing_gpus", 64, "scale: GPUs of the routing study")
_SLOWDOWN = flags.DEFINE_float("slowdown", 1.0, "scale: pareto sensitivity, roofline work "
                               "times this (a system reaching 1/slowdown of the roofline)")
_EXPERIMENTS = flags.DEFINE_list("experiments", ["anchors", "ep", "pareto", "routing", "balance"],
                                 "scale: which studies")
# mlperf
_MLPERF_DEVICE = flags.DEFINE_string("mlperf_device", "gb300", "mlperf: device of the records' "
                                     "systems (the published rows are GB300 NVL72's, 8 or 72 "
                                     "GPUs)")
_CONFIG = flag_config.define_config(__file__)


def measured_acceptance(k: int = 3) -> tuple[float, ...]:
  """P(accepted > j) measured on the default model (bench_speculative.json)."""
  with open(os.path.join(RESULTS, "bench_speculative.json")) as f:
    rows = json.load(f)["rows"]
  row = next(r for r in rows if r["K"] == k and r["batch"] == 1)
  return tuple(row["acceptance_per_position"])


def _acceptance(text: str) -> tuple[float, ...]:
  if text == "trtllm":
    return TRTLLM_R1_ACCEPTANCE
  if text == "measured":
    return measured_acceptance()
  return tuple(float(x) for x in text.split(","))


def _plot_calibration(rows, path, steps):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for run_index in sorted({s["run"] for s in steps}):
    sel = [s for s in steps if s["run"] == run_index]
    axes[0].scatter([s["measured_ms"] for s in sel], [s["predicted_ms"] for s in sel], s=5,
                    alpha=0.4, label=f"calibration run {run_index}")
  top = max(s["measured_ms"] for s in steps)
  axes[0].plot([0, top], [0, top], "k--", lw=1)
  axes[0].set(xlabel="measured step (ms)", ylabel="fitted step (ms)", title="step times",
              xscale="log", yscale="log")
  axes[0].legend(fontsize=7)
  for ax, key, label in ((axes[1], "tokens_per_s", "tokens/s"),
                         (axes[2], "mean_ttft_ms", "mean TTFT (ms)")):
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["measured"][key] for r in rows], 0.4, label="real engine")
    ax.bar([i + 0.2 for i in x], [r["predicted"][key] for r in rows], 0.4, label="simulator")
    ax.set_xticks(list(x), [r["workload"] for r in rows])
    ax.set(ylabel=label, title=f"{label}: simulator vs real", yscale="log")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _plot_scale(rows, path, limits):
  import matplotlib
  import matplotlib.ticker
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(18, 5))
  pareto = [r for r in rows if r["experiment"] == "pareto"]
  for curve in dict.fromkeys(r["curve"] for r in pareto):
    sel = [r for r in pareto if r["curve"] == curve]  # in concurrency order
    axes[0].plot([r["tpot_ms"]["p99"] for r in sel], [r["tokens_per_s_per_gpu"] for r in sel],
                 "o-" if sel[0]["mode"] == "disaggregated" else "s--", ms=3, label=curve)
  for tpot, _ in limits:
    axes[0].axvline(tpot, color="gray", lw=1)
  axes[0].set(xlabel="p99 TPOT (ms)", ylabel="tokens/s/GPU", xscale="log",
              title="Pareto (closed-loop concurrency sweep)")
  axes[0].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  axes[0].set_xticks([3, 5, 10, 15, 20, 40, 80])
  mid = [r for r in pareto if r["concurrency_per_decode_rank"] == 64]
  bottom = [0.0] * len(mid)
  for name in sorted({k for r in mid for k in r["parts_ms"]}):
    v = [r["parts_ms"].get(name, 0.0) for r in mid]
    axes[1].barh(range(len(mid)), v, left=bottom, label=name)
    bottom = [b + x for b, x in zip(bottom, v)]
  axes[1].set_yticks(range(len(mid)), [r["curve"] for r in mid], fontsize=6)
  axes[1].set(xlabel="mean step time (ms)",
              title="where a step's time goes (64 in flight per decode rank)")
  ep = [r for r in rows if r["experiment"] == "ep" and r["fits"]]
  for dev in dict.fromkeys(r["device"] for r in ep):
    sel = [r for r in ep if r["device"] == dev]
    axes[2].plot([r["gpus"] for r in sel], [r["b128"]["tokens_per_s_per_gpu"] for r in sel],
                 "o-", label=dev)
  axes[2].set(xlabel="GPUs in the instance (attention DP = EP)", xscale="log",
              ylabel="decode tokens/s/GPU (roofline, 128 per GPU)", title="EP size and device")
  for ax, size in ((axes[0], 6), (axes[1], 6), (axes[2], 7)):
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=size)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def calibrate_check_main():
  model = _MODEL.load(dtype="float32")
  cfg, params = model.cfg, model.params
  out = sim_calibration.calibrate_check(
      cfg=cfg, params=params, num_pages=_NUM_PAGES.value, max_num_seqs=_MAX_NUM_SEQS.value,
      max_num_batched_tokens=_BUDGET.value, tolerance=_TOLERANCE.value,
      rounds=_ROUNDS_CHECK.value, seed=_SEED.value)
  c = out["calibration"]
  print("\npooled fit t = " + " + ".join(f"{v:.3g} * {f}" for f, v in zip(
      c["features"], c["coef_pooled"])) + f"; mean |error| per step "
      f"{100 * c['fit_mean_abs_rel_err']:.0f}%; mean step per calibration run "
      + ", ".join(f"{v:.1f}" for v in c["mean_step_ms_per_run"]) + " ms at load average "
      + ", ".join(f"{v:.1f}" for v in c["load_average_per_run"]))
  for r in out["rows"]:
    m, p = r["measured"], r["predicted"]
    print(f"{r['workload']:<20s} tokens/s real {m['tokens_per_s']:7.1f} sim "
          f"{p['tokens_per_s']:7.1f} (x{r['tokens_per_s_ratio']:.2f} "
          f"{'OK' if r['tokens_per_s_within'] else 'OFF'})   mean TTFT real "
          f"{m['mean_ttft_ms']:7.1f} sim {p['mean_ttft_ms']:7.1f} ms "
          f"(x{r['mean_ttft_ms_ratio']:.2f} {'OK' if r['mean_ttft_ms_within'] else 'OFF'})   "
          f"steps real {m['steps']:.0f} sim {p['steps']:.0f}   (medians of {r['rounds']} rounds; "
          f"ratios per round " + ", ".join(
              f"{a:.2f}/{b:.2f}" for a, b in zip(r["tokens_per_s_ratio_per_round"],
                                                 r["mean_ttft_ms_ratio_per_round"])) + ")")
  results.write(_OUT.value or os.path.join(RESULTS, "sim_calibration"), out["rows"],
                lambda rows, path: _plot_calibration(rows, path, out["steps"]),
                model=model.name, calibration=c)


def scale_main():
  limits = ((15.0, 1500.0), (80.0, 2000.0))  # DeepSeek-R1 Interactive, Server (p99 ms)
  acceptance = _acceptance(_ACCEPTANCE.value)
  extra = {}
  if _EXTRA_ACCEPTANCE.value and _ACCEPTANCE.value != "measured":
    extra["measured"] = measured_acceptance()
  out = sim_scale.scale_study(
      model=_SIM_MODEL.value, devices=_DEVICES.value, gpus=[int(g) for g in _GPUS.value],
      pareto_device=_PARETO_DEVICE.value, pareto_gpus=_PARETO_GPUS.value, isl=_ISL.value,
      osl=_OSL.value, weight_dtype=_WEIGHT_DTYPE.value, kv_dtype=_KV_DTYPE.value,
      concurrencies=[int(c) for c in _CONCURRENCY.value], mtp_ks=[int(k) for k in _MTP.value],
      colo_budgets=[int(b) for b in _COLO_BUDGETS.value],
      disagg_splits=[tuple(int(x) for x in s.split(":")) for s in _SPLITS.value],
      disagg_mtp_ks=[int(k) for k in _DISAGG_MTP.value], acceptance=acceptance,
      extra_acceptance=extra, prefill_ep=_PREFILL_EP.value,
      price_per_gpu_hour=_PRICE.value, limits=limits, rounds=_ROUNDS.value,
      routing_gpus=_ROUTING_GPUS.value, slowdown=_SLOWDOWN.value,
      experiments=_EXPERIMENTS.value, seed=_SEED.value)
  results.write(_OUT.value or os.path.join(RESULTS, "sim_scale"), out["rows"],
                lambda rows, path: _plot_scale(rows, path, limits), best=out["best"],
                acceptance=acceptance, flags={f: flags.FLAGS[f].value for f in (
                    "sim_model", "devices", "gpus", "pareto_device", "pareto_gpus", "isl",
                    "osl", "weight_dtype", "kv_dtype", "concurrency", "mtp", "disagg_mtp",
                    "colo_budgets", "disagg_splits", "prefill_ep", "acceptance",
                    "price_per_gpu_hour", "rounds", "routing_gpus", "slowdown", "experiments",
                    "seed")})


def mlperf_main():
  out = sim_mlperf.mlperf_study(device=_MLPERF_DEVICE.value)
  results.write(_OUT.value or os.path.join(RESULTS, "mlperf_sim"), out.pop("rows"),
                lambda rows, path: sim_mlperf.plot(rows, path, out["ablation"]), **out)


def main(argv):
  del argv
  flag_config.apply_config(_CONFIG.value, flags.FLAGS, __file__)
  {"calibrate_check": calibrate_check_main, "scale": scale_main,
   "mlperf": mlperf_main}[_MODE.value]()


if __name__ == "__main__":
  cli.run(main)
