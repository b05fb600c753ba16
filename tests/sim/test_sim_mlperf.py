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
