"""The cluster simulator against MLPerf Inference's published GB300 NVL72
table (`jaxinfer/sim/mlperf.py`): predicted vs published tokens/s per GPU
for DeepSeek-R1 and Llama 3.1 405B, v5.1 and v6.0, with the configuration
the search found, and the v5.1 -> v6.0 ablation for DeepSeek-R1 Server and
Offline (measured 2.77x and 1.68x)."""

from __future__ import annotations

import dataclasses

from jaxinfer.sim import mlperf

MEASURED_GAIN = {"Server": 8064.0 / 2907.0, "Offline": 9821.0 / 5842.0}


def format_config(c: dict | None) -> str:
  if c is None:
    return "none holds the limits"
  lay = (f"DP{c['ranks']} attn + EP{c['ep']}" if c["ranks"] > 1 else
         f"TP{c['tp']}" + (f" + EP{c['ep']}" if c["ep"] > 1 else ""))
  mtp = f", MTP{c['mtp_k']}" if c["mtp_k"] else ""
  if c["mode"] == "colocated":
    return f"co-located {lay}, chunk {c['chunk']}, batch {c['batch']}/rank{mtp}"
  return (f"disagg {c['prefill_gpus']}P:{mlperf.SYSTEM_GPUS - c['prefill_gpus']}D, decode {lay}, "
          f"batch {c['batch']}/rank{mtp}")


def mlperf_study(*, device: str = "gb300", log=print) -> dict:
  eff = mlperf.Efficiency()
  log(f"== MLPerf Inference on {mlperf.SYSTEM_GPUS} {device}: predicted vs published tokens/s "
      f"per GPU ==")
  log(f"{'benchmark':<14s} {'scenario':<12s} {'round':<5s} {'published':>9s} "
      f"{'predicted':>9s} {'ratio':>6s}  configuration (p99 TPOT / TTFT ms, mean batch per rank)")
  rows = mlperf.predict_table(eff=eff, dev=device)
  for r in rows:
    lat = (f" ({r['tpot_ms']:.1f} / {r['ttft_ms']:.0f}, mean batch {r['mean_batch']:.0f})"
           if r["tpot_ms"] is not None else "")
    log(f"{r['benchmark']:<14s} {r['scenario']:<12s} {r['round']:<5s} "
        f"{r['published_per_gpu']:9.0f} {r['predicted_per_gpu']:9.0f} {r['ratio']:6.2f}  "
        f"{format_config(r['config'])}{lat}")
  within = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
  log(f"{within} of {len(rows)} rows within 25% of the published figure")
  ablations = []
  for scenario in ("Server", "Offline"):
    a = mlperf.ablation("deepseek-r1", scenario, eff=eff, dev=device)
    a["measured_ratio"] = MEASURED_GAIN[scenario]
    ablations.append(a)
    log(f"\n== ablation, DeepSeek-R1 {scenario}: v5.1-like {a['v51_per_gpu']:.0f} -> v6.0-like "
        f"{a['v60_per_gpu']:.0f} tokens/s/GPU, predicted x{a['predicted_ratio']:.2f} "
        f"(product of the factors x{a['product']:.2f}) vs measured x{a['measured_ratio']:.2f} ==")
    for s in a["steps"]:
      log(f"  x{s['factor']:.3f}  {s['technique']:<14s} -> {s['per_gpu']:7.0f}  {s['cause']}")
  return dict(rows=rows, ablation=ablations, within_25pct=within,
              efficiency=dataclasses.asdict(eff),
              workloads={k: dataclasses.asdict(w) for k, w in mlperf.WORKLOADS.items()},
              hardware_sources=mlperf.HARDWARE_SOURCES)


def plot(rows, path, ablations) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
  x = range(len(rows))
  axes[0].bar([i - 0.2 for i in x], [r["published_per_gpu"] for r in rows], 0.4,
              label="published (MLPerf)")
  axes[0].bar([i + 0.2 for i in x], [r["predicted_per_gpu"] for r in rows], 0.4,
              label="simulator")
  axes[0].set_xticks(list(x), [f"{r['benchmark'][:8]}\n{r['scenario']} {r['round']}"
                               for r in rows], fontsize=6)
  axes[0].set(yscale="log", ylabel="tokens/s per GPU", title="GB300 NVL72: predicted vs published")
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
