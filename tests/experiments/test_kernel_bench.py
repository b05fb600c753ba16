"""The kernel benchmark end to end on CPU: tiny shapes, interpret mode, a tmp dir."""

import json
import math
import time

import pytest

from benchlib import kernels
from benchlib.kernels import KERNELS, run_kernel_bench


def _finite_positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_writes_json_with_every_kernel(tmp_path):
  res = run_kernel_bench(kernels=KERNELS, shapes="tiny", dtype="float32", interpret=True,
                         repeats=2, warmup=1, peers=True, out_dir=str(tmp_path))
  [path] = tmp_path.glob("kernel_bench_cpu_*.json")
  assert str(path) == res["json_path"]
  data = json.loads(path.read_text())

  roof = data["roofline"]
  for field in ("hbm_gbps", "matmul_tflops", "copy_bytes", "matmul_m"):
    assert _finite_positive(roof[field]), field
  assert set(data["conventions"]) >= {"flops", "bytes", "roofline_frac", "ours_over_peer_time"}

  assert set(data["results"]) == set(KERNELS)
  for kernel in KERNELS:
    assert data["results"][kernel], kernel
    for entry in data["results"][kernel]:
      assert _finite_positive(entry["flops"]) and _finite_positive(entry["bytes"])
      ours = entry["impls"]["ours"]
      assert ours["status"] == "ok", (kernel, entry["label"], ours)
      for field in ("time_s", "tflops", "gbps", "frac_peak_flops", "frac_peak_bw",
                    "roofline_frac"):
        assert _finite_positive(ours[field]), (kernel, field, ours[field])
      assert ours["rel_err"] < 1e-4 and ours["numerics_ok"], (kernel, entry["label"], ours)
      # At least one peer ran on CPU (XLA attention or the jnp reference) and was compared.
      ran = [r for n, r in entry["impls"].items() if n != "ours" and r["status"] == "ok"]
      assert ran and all(_finite_positive(r["ours_over_peer_time"]) for r in ran), entry
      for name, rec in entry["impls"].items():
        assert rec["status"] in ("ok", "skipped", "error"), (name, rec)
  # GPU-only peers are recorded as skipped, not silently dropped.
  flash = data["results"]["flash"][0]["impls"]
  for peer in ("cudnn", "jax_pallas_mha", "torch_sdpa"):
    assert flash[peer]["status"] == "skipped", (peer, flash[peer])
  qmm = data["results"]["qmatmul"][0]["impls"]
  assert qmm["xla_dequant_dot"]["numerics_ok"] and qmm["bf16_weight_dot"]["numerics_ok"]
  # The winner table beside it: a row per case, each winner a candidate that
  # ran and matched the reference; and the dry run lists exactly the
  # candidates the run recorded, case by case.
  winners = json.loads((tmp_path / path.name.replace("kernel_bench_", "kernel_winners_"))
                       .read_text())
  assert winners["meta"]["device_kind"] == data["meta"]["device_kind"]
  assert len(winners["rows"]) == sum(map(len, data["results"].values()))
  for row in winners["rows"]:
    assert row["winner"] in row["matched"] and set(row["matched"]) <= set(row["ran"]), row
  listing = kernels.list_candidates(kernels=KERNELS, shapes="tiny", dtype="float32")
  for kernel in KERNELS:
    assert ([(c["case"], [x["name"] for x in c["candidates"]]) for c in listing[kernel]]
            == [(e["label"], list(e["impls"])) for e in data["results"][kernel]]), kernel
  assert {c["name"]: c["skip"] for c in listing["flash"][0]["candidates"]}["cudnn"] == "GPU only"


def test_deadline_skips_what_would_start_past_it():
  """A sweep whose deadline has passed measures the roofline and records every
  case as skipped by the time box; none is silently dropped."""
  env, dev = kernels.bench_env(dtype="float32", interpret=True)
  result = kernels.new_result(env, dev, kernels=["paged", "qmatmul"], shapes="tiny", repeats=1,
                              warmup=0)
  saves = []
  kernels.sweep(result, env, shapes="tiny", repeats=1, warmup=0,
                save=lambda: saves.append(1), deadline=time.monotonic() - 1)
  assert result["roofline"]["hbm_gbps"] > 0 and saves
  assert result["results"] == {"paged": [], "qmatmul": []}
  assert len(result["skipped"]) == 4 and all("time box" in s for s in result["skipped"])


def test_rejects_unknown_kernel(tmp_path):
  with pytest.raises(ValueError, match="kernels"):
    run_kernel_bench(kernels=["flash", "nope"], shapes="tiny", out_dir=str(tmp_path))
