"""The MLPerf scenarios over the simulator's step-cost model (sim/mlperf.py)."""

import dataclasses
import math

import pytest

from jaxinfer.sim import mlperf

V60 = mlperf.ROUND_TECHNIQUES["v6.0"]
V51 = mlperf.ROUND_TECHNIQUES["v5.1"]


def test_search_holds_the_scenario_limits():
  for scenario in ("Server", "Interactive"):
    best = mlperf.search("deepseek-r1", scenario, V60)
    sc = mlperf.SCENARIOS[("deepseek-r1", scenario)]
    assert best is not None and best["per_gpu"] > 0
    assert best["tpot_ms"] <= sc.tpot_ms and best["ttft_ms"] <= sc.ttft_ms
  # The tighter Interactive limits cost throughput.
  assert (mlperf.search("deepseek-r1", "Interactive", V60)["per_gpu"]
          < mlperf.search("deepseek-r1", "Server", V60)["per_gpu"])


@pytest.mark.parametrize("field, value, direction", [
    ("fused_kernels", 0.5, -1),  # slower kernels: fewer tokens/s
    ("attn_balance", 0.7, -1),  # worse attention-DP balance: fewer
    ("max_batch", 128, -1),  # a smaller batch cap: fewer (Offline)
])
def test_assumed_efficiency_moves_the_prediction(field, value, direction):
  base = mlperf.search("deepseek-r1", "Offline", V60)["per_gpu"]
  eff = dataclasses.replace(mlperf.Efficiency(), **{field: value})
  changed = mlperf.search("deepseek-r1", "Offline", V60, eff=eff)["per_gpu"]
  assert (changed - base) * direction > 0.01 * base


def test_slot_queueing_for_server_scenarios():
  # Pooling a system's decode slots queues less than pooling one instance's.
  base = mlperf.search("deepseek-r1", "Server", V51)
  eff = dataclasses.replace(mlperf.Efficiency(), slot_pool="instance")
  assert mlperf.search("deepseek-r1", "Server", V51, eff=eff)["per_gpu"] < base["per_gpu"]
  # Server never beats Offline; its mean batch stays under the slot cap.
  assert base["per_gpu"] <= mlperf.search("deepseek-r1", "Offline", V51)["per_gpu"]
  assert base["mean_batch"] < base["config"]["batch"]
  # More load: a longer p99 wait; a longer budget admits more load.
  assert mlperf._slot_wait_p99(512, 500, 60.0) > mlperf._slot_wait_p99(512, 450, 60.0)
  assert mlperf.served_load(512, 60.0, 2.0) > mlperf.served_load(512, 60.0, 0.5)
  assert mlperf._erlang_c(512, 600) == 1.0 and mlperf._erlang_c(512, 100) < 1e-9


def test_longer_outputs_in_flight_cost_throughput():
  base = mlperf.search("deepseek-r1", "Offline", V60)["per_gpu"]
  w = mlperf.WORKLOADS["deepseek-r1"]
  short = dataclasses.replace(w, osl_age_mean=w.osl_mean / 2)  # every output the mean length
  old = mlperf.WORKLOADS["deepseek-r1"]
  mlperf.WORKLOADS["deepseek-r1"] = short
  try:
    assert mlperf.search("deepseek-r1", "Offline", V60)["per_gpu"] > 1.05 * base
  finally:
    mlperf.WORKLOADS["deepseek-r1"] = old


def test_sourced_workload_statistics():
  r1, l405 = mlperf.WORKLOADS["deepseek-r1"], mlperf.WORKLOADS["llama3.1-405b"]
  assert (r1.isl_mean, r1.isl_p99, r1.osl_mean, r1.osl_age_mean) == (803.8, 1432.0, 3886.2, 4354.0)
  assert (l405.isl_mean, l405.isl_p99, l405.osl_mean) == (9428.6, 18956.0, 684.68)
  for w in (r1, l405):
    assert w.isl_mean < w.isl_p99 and w.osl_age_mean > 0


def test_unfused_kernels_only_change_v51():
  base = mlperf.search("llama3.1-405b", "Offline", V51)["per_gpu"]
  eff = dataclasses.replace(mlperf.Efficiency(), unfused_kernels=0.9)
  assert mlperf.search("llama3.1-405b", "Offline", V51, eff=eff)["per_gpu"] > 1.2 * base
  assert (mlperf.search("llama3.1-405b", "Offline", V60, eff=eff)["per_gpu"]
          == mlperf.search("llama3.1-405b", "Offline", V60)["per_gpu"])


def test_ablation_factors_multiply_to_the_predicted_ratio():
  a = mlperf.ablation("deepseek-r1", "Server")
  assert [s["technique"] for s in a["steps"]] == list(mlperf.TECHNIQUE_ORDER)
  assert a["product"] == pytest.approx(a["predicted_ratio"], rel=1e-9)
  assert a["v60_per_gpu"] == pytest.approx(
      mlperf.search("deepseek-r1", "Server", V60)["per_gpu"])
  assert all(s["factor"] >= 1 - 1e-9 for s in a["steps"])  # each adds an option
  assert all(s["cause"] for s in a["steps"])


def test_published_rows_and_sources():
  assert {(r["benchmark"], r["scenario"]) for r in mlperf.PUBLISHED} <= set(mlperf.SCENARIOS)
  ratio = {s: next(r["per_gpu"] for r in mlperf.PUBLISHED if r["scenario"] == s
                   and r["round"] == "v6.0" and r["benchmark"] == "deepseek-r1")
           / next(r["per_gpu"] for r in mlperf.PUBLISHED if r["scenario"] == s
                  and r["round"] == "v5.1" and r["benchmark"] == "deepseek-r1")
           for s in ("Server", "Offline")}
  assert math.isclose(ratio["Server"], 2.77, abs_tol=0.01)
  assert math.isclose(ratio["Offline"], 1.68, abs_tol=0.01)
  assert set(mlperf.HARDWARE_SOURCES) == {"gb300", "b200", "h200", "h100"}
