"""The cluster simulator against MLPerf Inference's published GB300 table
(`jaxinfer/sim/mlperf.py`): predicted vs published tokens/s per GPU for
DeepSeek-R1 and Llama 3.1 405B, v5.1 and v6.0, each on the system of the
submission that published it (8 or 72 GPUs), with the configuration the
search found and the model at the record's own deployment, and the v5.1 ->
v6.0 ablation for DeepSeek-R1 Server and Offline (measured 2.77x and 1.68x)."""

from __future__ import annotations

import dataclasses

from jaxinfer.sim import mlperf

MEASURED_GAIN = {"Server": 8064.0 / 2907.0, "Offline": 9821.0 / 5842.0}


def format_config(c: dict | None, system_gpus: int = 72) -> str:
  if c is None:
    return "none holds the limits"
  lay = (f"DEP{c['ranks']}" if c["ranks"] > 1 else
         f"TP{c['tp']}" + (f" + EP{c['ep']}" if c["ep"] > 1 else ""))
  n = system_gpus - c["prefill_gpus"]
  lay += f" x{n // (c['tp'] * c['ranks'])}"
  mtp = f", MTP{c['mtp_k']}" if c["mtp_k"] else ""
  if c["mode"] == "colocated":
    return f"co-located {lay}, chunk {c['chunk']}, batch {c['batch']}/rank{mtp}"
  return (f"disagg {c['prefill_gpus']}P:{n}D, decode {lay}, batch {c['batch']}/rank{mtp}")


def measured_account(scenario: str) -> list[dict]:
  """The published v5.1 -> v6.0 gain split by the records' own logs (factors
  multiplying to it). Server: tokens/s per rank = sequences in flight / TPOT
  (Little's law), so the gain is the in-flight ratio times the TPOT ratio.
  Offline: NVIDIA's 72-GPU v6.0 entry ran the v5.1 config file unchanged
  (DEP8 x9, batch 1536, 6656 tokens, CUTLASS MoE), so its gain over v5.1 is
  the software's; the published v6.0 row is CoreWeave's 8-GPU entry (batch
  1024, CUTEDSL MoE)."""
  pub = {(p["scenario"], p["round"]): p for p in mlperf.PUBLISHED
         if p["benchmark"] == "deepseek-r1"}
  old, new = pub[(scenario, "v5.1")], pub[(scenario, "v6.0")]
  if scenario == "Server":
    a, b = old["record"].log, new["record"].log
    return [dict(factor=b["in_flight_per_rank"] / a["in_flight_per_rank"],
                 cause=f"sequences in flight per rank, {a['in_flight_per_rank']:.0f} -> "
                       f"{b['in_flight_per_rank']:.0f} (v5.1 TTFT-bound: p99 "
                       f"{a['ttft_p99_ms']:.0f} ms of 2000)"),
            dict(factor=a["tpot_mean_ms"] / b["tpot_mean_ms"],
                 cause=f"mean TPOT {a['tpot_mean_ms']:.1f} -> {b['tpot_mean_ms']:.1f} ms")]
  nv = next(o["per_gpu"] for o in mlperf.OTHER_GB300_V60
            if o["submitter"] == "NVIDIA" and o["scenario"] == "Offline")
  return [dict(factor=nv / old["per_gpu"], cause="software on the same config file (NVIDIA "
               "72 GPUs, v6.0 vs v5.1)"),
          dict(factor=new["per_gpu"] / nv, cause="the published v6.0 row's submission "
               "(CoreWeave, 8 GPUs, batch 1024, CUTEDSL MoE) over NVIDIA's 72-GPU entry")]


def _log_table(rows, log) -> None:
  log(f"{'benchmark':<14s} {'scenario':<12s} {'round':<5s} {'GPUs':>4s} {'published':>9s} "
      f"{'predicted':>9s} {'ratio':>6s} {'at rec':>6s}  configuration found (TPOT / TTFT ms, "
      f"mean batch per rank)")
  for r in rows:
    lat = (f" ({r['tpot_ms']:.1f} / {r['ttft_ms']:.0f}, {r['mean_batch']:.0f})"
           if r["tpot_ms"] is not None else "")
    log(f"{r['benchmark']:<14s} {r['scenario']:<12s} {r['round']:<5s} {r['system_gpus']:4d} "
        f"{r['published_per_gpu']:9.0f} {r['predicted_per_gpu']:9.0f} {r['ratio']:6.2f} "
        f"{r['at_record_ratio']:6.2f}  {format_config(r['config'], r['system_gpus'])}{lat}")
  log("\n== the records (submitter, deployment; Server logs: in flight per rank, TPOT mean / "
      "p99, TTFT p99) against the model at that deployment ==")
  for r in rows:
    log(f"{r['benchmark']} {r['scenario']} {r['round']}: {r['submitter']}, "
        f"{r['record_deployment']}")
    m = r["record_log"]
    if m:
      a = r["at_record_config"]
      log(f"    log: {m['in_flight_per_rank']:.0f} in flight, TPOT {m['tpot_mean_ms']:.1f} / "
          f"{m['tpot_p99_ms']:.1f}, TTFT {m['ttft_p99_ms']:.0f}; model at the record: "
          f"{format_config(a, r['system_gpus'])} -> {r['at_record_per_gpu']:.0f}/GPU")


def mlperf_study(*, device: str = "gb300", log=print) -> dict:
  eff = mlperf.Efficiency()
  log(f"== MLPerf Inference on {device}: predicted vs published tokens/s per GPU, each on the "
      f"publishing submission's system; 'at rec' = the model at the record's deployment ==")
  rows = mlperf.predict_table(eff=eff, dev=device)
  _log_table(rows, log)
  within = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
  at_rec = sum(abs(r["at_record_ratio"] - 1) <= 0.25 for r in rows)
  log(f"{within} of {len(rows)} rows within 25% of the published figure (searched); {at_rec} of "
      f"{len(rows)} at the records' deployments")
  ablations = []
  for scenario in ("Server", "Offline"):
    a = mlperf.ablation("deepseek-r1", scenario, eff=eff, dev=device)
    a["measured_ratio"] = MEASURED_GAIN[scenario]
    ablations.append(a)
    log(f"\n== ablation, DeepSeek-R1 {scenario}: v5.1 {a['v51_per_gpu']:.0f} -> v6.0 "
        f"{a['v60_per_gpu']:.0f} tokens/s/GPU, predicted x{a['predicted_ratio']:.2f} "
        f"(product of the factors x{a['product']:.2f}) vs measured x{a['measured_ratio']:.2f} ==")
    for s in a["steps"]:
      log(f"  x{s['factor']:.3f}  {s['technique']:<14s} -> {s['per_gpu']:7.0f}  {s['cause']}")
    a["measured_account"] = measured_account(scenario)
    log("  the measured gain by the records' logs: " + " x ".join(
        f"{m['factor']:.2f} ({m['cause']})" for m in a["measured_account"]))
  return dict(rows=rows, ablation=ablations, within_25pct=within, at_record_within_25pct=at_rec,
              efficiency=dataclasses.asdict(eff),
              workloads={k: dataclasses.asdict(w) for k, w in mlperf.WORKLOADS.items()},
              other_gb300_v60=mlperf.OTHER_GB300_V60, hardware_sources=mlperf.HARDWARE_SOURCES)


def plot(rows, path, ablations) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
  x = range(len(rows))
  axes[0].bar([i - 0.27 for i in x], [r["published_per_gpu"] for r in rows], 0.27,
              label="published (MLPerf)")
  axes[0].bar(list(x), [r["predicted_per_gpu"] for r in rows], 0.27, label="simulator, searched")
  axes[0].bar([i + 0.27 for i in x], [r["at_record_per_gpu"] for r in rows], 0.27,
              label="simulator, record's deployment")
  axes[0].set_xticks(list(x), [f"{r['benchmark'][:8]}\n{r['scenario']} {r['round']}"
                               for r in rows], fontsize=6)
  axes[0].set(yscale="log", ylabel="tokens/s per GPU", title="GB300: predicted vs published")
  axes[0].legend(fontsize=7)
  for a in ablations:
    names = ["v5.1"] + [s["technique"] for s in a["steps"]]
    vals = [a["v51_per_gpu"]] + [s["per_gpu"] for s in a["steps"]]
    axes[1].plot(names, vals, "o-", label=f"{a['scenario']} (x{a['predicted_ratio']:.2f} "
                 f"predicted, x{a['measured_ratio']:.2f} measured)")
  axes[1].tick_params(axis="x", labelsize=7, rotation=20)
  axes[1].set(ylabel="tokens/s per GPU", title="DeepSeek-R1 ablation v5.1 -> v6.0")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
