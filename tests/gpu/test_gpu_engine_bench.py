"""The GPU engine bench (`bench.gpu_engine`) in its dry run: the same code on
CPU at tiny shapes (Pallas interpreted), so the GPU day's engine part cannot
rot. Checks what it measured and how it records, not timings."""

import json
import math
import sys
import time
import types

import jax
import pytest

from benchlib import gpu_engine, torch_peer, trace_top
from jaxinfer import models, presets
from pallas_kernels.mosaic_paged_attention import available as mosaic_available

ROOF = dict(hbm_gbps=20.0, matmul_tflops=0.2)  # as bench.kernels.measure_roofline gives it


def _entries(record):
  """{path: entry} of every sub-measurement (a dict with a status) under the models."""
  out = {}

  def walk(node, path):
    if isinstance(node, dict):
      if "status" in node and path:
        out[path] = node
        return
      for k, v in node.items():
        walk(v, f"{path}/{k}" if path else k)

  for role in ("dense", "moe"):
    if role in record:
      walk(record[role], role)
  return out


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
  path = tmp_path_factory.mktemp("gpu_engine") / "engine.json"
  record, saves = {}, []

  def save():
    saves.append(len(_entries(record)))
    path.write_text(json.dumps(record, indent=1))

  t0 = time.monotonic()
  gpu_engine.run_engine_bench(record, save, deadline=time.monotonic() + 600, dry_run=True,
                              roofline=ROOF)
  return record, path, saves, time.monotonic() - t0


def _every_measurement_ran(dry):
  record, _, _, _ = dry
  entries = _entries(record)
  plan = {role: shapes for role, _, shapes in gpu_engine.plan(dry_run=True)}
  expected = {f"{role}/{k}" for role in plan for k in ("init", "pallas_vs_xla")}
  expected |= {f"{role}/decode/batch_{b}" for role, s in plan.items() for b in s.batches}
  expected |= {"dense/prefill"} | {f"moe/mtp/k_{k}" for k in plan["moe"].mtp_ks}
  expected |= {f"{role}/mosaic/batch_{b}" for role, s in plan.items() for b in s.mosaic_batches}
  expected |= {f"{role}/scanned/batch_{b}" for role, s in plan.items()
               for b in s.scanned_batches}
  expected |= {f"{role}/torch_peer" for role, s in plan.items() if s.peer_batches}
  assert plan["dense"].mosaic_batches and plan["dense"].scanned_batches
  assert "dense/torch_peer" in expected
  assert plan["moe"].mtp_ks and plan["moe"].mtp_ks[-1] == 3  # the largest draft count runs
  assert set(entries) == expected
  bad = {p: e for p, e in entries.items() if e["status"] != "ok"}
  assert not bad
  assert record["meta"]["platform"] == "cpu" and record["meta"]["dry_run"] is True
  assert record["meta"]["jax"] and record["meta"]["device_kind"]
  assert record["roofline"]["source"] == "given"


def _decode_against_the_roofline(dry):
  record, _, _, _ = dry
  for role in ("dense", "moe"):
    for key, e in record[role]["decode"].items():
      assert e["tokens_per_s"] > 0 and e["step_s"] > 0 and e["first_call_s"] > 0, key
      assert e["decode_steps"] >= 1 and e["tpot_s"] > 0
      assert e["roofline_tokens_per_s"] == pytest.approx(
          e["batch"] * ROOF["hbm_gbps"] * 1e9 / e["bytes_per_step"]["total"])
      assert e["fraction_of_roofline"] == pytest.approx(
          e["tokens_per_s"] / e["roofline_tokens_per_s"])
      # Compiled once per shape: the timed run compiled nothing.
      assert e["xla_compiles_timed"] == 0 and e["compiles_after"] == e["compiles_warm"], key
  moe = record["moe"]["decode"]["batch_8"]
  # Routed experts: fewer than all are counted, and reading all would cost more.
  assert moe["experts_touched_per_layer"] < record["moe"]["config"]["num_experts"]
  assert moe["bytes_per_step_all_experts"] > moe["bytes_per_step"]["total"]


def _prefill_against_the_compute_roofline(dry):
  record, _, _, _ = dry
  e = record["dense"]["prefill"]
  cfg = presets.get("tiny_dense", num_layers=2)
  assert e["flops"] == gpu_engine.prefill_flops(cfg, e["batch"], e["prompt_len"])
  assert e["prefill_tokens_per_s"] > 0 and e["tflops"] > 0
  assert e["fraction_of_roofline"] == pytest.approx(e["tflops"] / ROOF["matmul_tflops"])


def test_prefill_flops_hand_count():
  cfg = presets.get("tiny_dense")  # V 256, D 128, L 4, N 4, K 2, H 32, F 384
  V, D, L, N, K, H, F = 256, 128, 4, 4, 2, 32, 384
  B, T = 2, 10
  per_token = 2 * L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
  attn = L * B * 2 * N * (H + H) * T * (T + 1) / 2
  assert gpu_engine.prefill_flops(cfg, B, T) == per_token * B * T + 2 * D * V * B + attn


def _pallas_matches_xla_on_float32(dry):
  record, _, _, _ = dry
  for role in ("dense", "moe"):
    e = record[role]["pallas_vs_xla"]
    assert e["identical"] is True and e["match_fraction"] == 1.0, role
    assert e["first_divergence"] is None and e["identical_requests"] == e["requests"] == 8
    assert e["xla"]["tokens_per_s"] > 0


def _mtp_speculation(dry):
  record, _, _, _ = dry
  for k in gpu_engine.plan(dry_run=True)[1][2].mtp_ks:
    e = record["moe"]["mtp"][f"k_{k}"]
    assert e["K"] == k and e["tokens_per_s"] > 0 and e["step_s"] > 0
    assert 1.0 <= e["mean_accepted_length"] <= k + 1
    assert len(e["acceptance_per_position"]) == k
    # Greedy speculation is lossless: the tokens of plain greedy decoding.
    assert e["same_tokens_as_plain"] == 1.0
    assert e["speedup_vs_plain"] > 0


def _mosaic_against_pallas(dry):
  record, _, _, _ = dry
  for key, e in record["dense"]["mosaic"].items():
    # float32 on CPU (or jax < 0.11): the step falls back to Pallas, and says why.
    assert e["kernel"].startswith("pallas (") and len(e["kernel"]) > len("pallas ()"), key
    assert e["identical"] is True and e["match_fraction"] == 1.0, key
    assert e["tokens_per_s"] > 0 and e["speedup_vs_pallas"] > 0, key


def _scanned_against_default(dry):
  record, _, _, _ = dry
  for key, e in record["dense"]["scanned"].items():
    # The stacked layers scanned: the default form's greedy tokens, on the roofline.
    assert e["identical"] is True and e["match_fraction"] == 1.0, key
    assert e["tokens_per_s"] > 0 and e["decode_over_scanned"] > 0, key
    assert e["fraction_of_roofline"] == pytest.approx(
        e["tokens_per_s"] / e["roofline_tokens_per_s"])


def _check_table(t, k=trace_top.TOP_K):
  """A top-k table as trace_top.top_table makes it: sorted, counted, shares <= 1."""
  top = t["top"]
  assert 1 <= len(top) <= min(k, t["distinct"]) and t["events"] >= sum(r["count"] for r in top)
  assert all(r["count"] >= 1 and r["total_ms"] >= 0 for r in top)
  assert [r["total_ms"] for r in top] == sorted((r["total_ms"] for r in top), reverse=True)
  assert t["top_share"] == pytest.approx(sum(r["share"] for r in top)) and t["top_share"] <= 1.0
  for r in top:
    assert r["share"] == pytest.approx(r["total_ms"] / t["traced_ms"])
  assert sum(r["total_ms"] for r in top) <= t["traced_ms"] * (1 + 1e-9)


def _decode_traced_once_per_model(dry):
  record, _, _, _ = dry
  for role, _, s in gpu_engine.plan(dry_run=True):
    assert s.trace_batch in s.batches, role
    for key, e in record[role]["decode"].items():
      assert ("trace" in e) == (key == f"batch_{s.trace_batch}"), (role, key)
    t = record[role]["decode"][f"batch_{s.trace_batch}"]["trace"]
    # CPU: no device plane, so the host's XLA op events, read back from the written trace.
    assert t["status"] == "ok", t
    assert t["source"] == "host" and t["plane"] == "/host:CPU" and t["trace_file_bytes"] > 0
    assert t["batch"] == s.trace_batch and t["xla_compiles"] == 0  # the warm programs
    assert t["decode_steps"] >= min(s.trace_steps, s.new_tokens - 1), t["decode_steps"]
    assert t["traced_ms"] > 0
    _check_table(t)


def _torch_peer_beside_our_decode(dry):
  record, _, _, _ = dry
  e = record["dense"]["torch_peer"]
  plan = {role: s for role, _, s in gpu_engine.plan(dry_run=True)}
  assert "torch_peer" not in record["moe"] and not plan["moe"].peer_batches
  # CPU: float32, eager (no compile), the tiny config's every parameter.
  assert e["dtype"] == "float32" and e["compile"] is None and e["device"] == "cpu"
  assert e["same_params_as_ours"] is True and e["cache_implementation"] == "static"
  assert e["prompt_len"] == plan["dense"].prompt_len and e["new_tokens"] == plan["dense"].new_tokens
  assert set(e["batches"]) == {f"batch_{b}" for b in plan["dense"].peer_batches} == {
      "batch_1", "batch_8"}
  for key, b in e["batches"].items():
    assert b["status"] == "ok" and b["compiled_decode"] is False, (key, b)
    assert math.isfinite(b["tokens_per_s"]) and b["tokens_per_s"] > 0, (key, b)
    assert b["decode_s"] == pytest.approx(b["generate_s"][str(e["new_tokens"])]
                                          - b["generate_s"]["1"])
    ours = record["dense"]["decode"][key]["tokens_per_s"]
    assert b["ours_tokens_per_s"] == ours
    assert b["ours_over_peer"] == pytest.approx(ours / b["tokens_per_s"])


def _saved_after_every_measurement(dry):
  record, path, saves, took = dry
  assert json.loads(path.read_text()) == json.loads(json.dumps(record))
  # One save per measurement at least: the entry count grows by at most one per save.
  assert saves[-1] == len(_entries(record))
  assert all(b - a <= 1 for a, b in zip(saves, saves[1:]))
  assert math.isfinite(record["meta"]["wall_s"]) and record["meta"]["wall_s"] <= took


def test_past_deadline_skips_without_errors(tmp_path):
  record, path = {}, tmp_path / "engine.json"
  save = lambda: path.write_text(json.dumps(record))
  gpu_engine.run_engine_bench(record, save, deadline=time.monotonic() - 1, dry_run=True,
                              roofline=ROOF)
  entries = _entries(record)
  assert entries and "dense/decode/batch_1" in entries and "moe/mtp/k_3" in entries
  for p, e in entries.items():
    assert e["status"] == "skipped", p
  assert record["dense"]["init"]["reason"] == "time box"
  assert record["moe"]["decode"]["batch_8"]["reason"] == "init skipped"
  assert record["dense"]["mosaic"]["batch_8"]["reason"] == "init skipped"
  assert record["dense"]["scanned"]["batch_8"]["reason"] == "init skipped"
  assert record["dense"]["torch_peer"]["reason"] == "init skipped"
  assert json.loads(path.read_text())["moe"]["pallas_vs_xla"]["status"] == "skipped"
  # Without a roofline it measures one itself, which the time box skips too.
  record.clear()
  gpu_engine.run_engine_bench(record, save, deadline=time.monotonic() - 1, dry_run=True)
  assert record["roofline"]["status"] == "skipped"
  assert record["dense"]["status"] == record["moe"]["status"] == "skipped"
  assert all(e["status"] != "error" for e in _entries(record).values())


def test_gpu_plan_shapes():
  """The real run's shapes: llama3_8b and the DeepSeek-V3 slice at full width,
  each decode within one page bucket (one decode program per batch)."""
  from jaxinfer.engine import steps
  plan = {role: (cfg, s) for role, cfg, s in gpu_engine.plan(dry_run=False)}
  (dense, ds), (moe, ms) = plan["dense"], plan["moe"]
  assert dense.d_model == 4096 and dense.num_layers == 32 and ds.batches == (1, 8, 64)
  # Each Mosaic run has its Pallas run to compare; the real shapes fit the Mosaic kernels
  # (where this jax has them, the GQA and the MLA one).
  assert ds.mosaic_batches == ds.batches and ms.mosaic_batches == ms.batches
  # Per-layer weights against the scan at the batches (1 and 64 dense, 64 MoE).
  assert set(ds.scanned_batches) == {1, 64} <= set(ds.batches)
  assert set(ms.scanned_batches) <= set(ms.batches)
  # Ten decode steps traced per model, at a batch it decodes; the torch peer at 1 and 8.
  for s in (ds, ms):
    assert s.trace_batch in s.batches and s.trace_steps == 10 <= s.new_tokens - 1
  assert ds.peer_batches == (1, 8) and set(ds.peer_batches) <= set(ds.batches)
  assert not ms.peer_batches
  for cfg, s in ((dense, ds), (moe, ms)):
    assert gpu_engine.mosaic_kernel(cfg, s, 8) in ("mosaic", f"pallas ({mosaic_available()})")
  assert moe.d_model == 7168 and moe.num_experts == 256 and moe.router == "sigmoid_grouped"
  assert [seg[0] for seg in moe.segments()] == [False, True] and moe.num_mtp_layers == 1
  assert ms.mtp_ks == (1, 2, 3) and moe.attention.latent
  assert gpu_engine.param_bytes(dense) == 2 * models.count_params(dense)  # bf16
  assert 8.0e9 < models.count_params(dense) < 8.1e9  # Llama-3.1-8B
  assert 50e9 < gpu_engine.param_bytes(moe) < 60e9  # two routed-expert blocks of ~22.5 GB
  for s in (ds, ms):
    extra = max(s.mtp_ks, default=-1) + 1
    pages = lambda n: -(-n // s.page_size)
    cap = 1 << 20
    assert steps.page_bucket(pages(s.prompt_len), cap) == steps.page_bucket(
        pages(s.prompt_len + s.new_tokens + extra), cap)


def test_fit_memory_makes_the_mtp_block_dense_when_short():
  plan = {role: (cfg, s) for role, cfg, s in gpu_engine.plan(dry_run=False)}
  cfg, s = plan["moe"]
  assert gpu_engine.fit_memory(cfg, s, None) == (cfg, "")
  same, note = gpu_engine.fit_memory(cfg, s, 130 << 30)  # an H200
  assert same == cfg and note.startswith("fits")
  lite, note = gpu_engine.fit_memory(cfg, s, 59 << 30)  # an H100 at jax's default 75%
  assert lite.dense_layers == (0, 2) and note.startswith("MTP block made dense")
  assert gpu_engine.param_bytes(lite) < gpu_engine.param_bytes(cfg) - (20 << 30)
  dense = plan["dense"][0]
  assert gpu_engine.fit_memory(dense, plan["dense"][1], 1 << 30) == (dense, "")


def test_dry_run_measures_everything(dry):
  """One test over the one dry run (each xdist worker would otherwise run it
  again for its share of the checks)."""
  for check in (_every_measurement_ran, _decode_against_the_roofline,
                _prefill_against_the_compute_roofline, _pallas_matches_xla_on_float32,
                _mtp_speculation, _mosaic_against_pallas, _scanned_against_default,
                _decode_traced_once_per_model, _torch_peer_beside_our_decode,
                _saved_after_every_measurement):
    check(dry)


def test_top_table_hand_made():
  events = [("gemm", 300.0), ("attn", 100.0), ("gemm", 500.0), ("norm", 50.0), ("attn", 150.0),
            ("add", 50.0), ("copy", 0.0)]
  t = trace_top.top_table("/device:GPU:0", events, k=3)
  assert t["plane"] == "/device:GPU:0" and t["events"] == 7 and t["distinct"] == 5
  assert t["traced_ms"] == pytest.approx(1150 / 1e6)
  assert [(r["name"], r["count"]) for r in t["top"]] == [("gemm", 2), ("attn", 2), ("add", 1)]
  assert [r["total_ms"] for r in t["top"]] == pytest.approx([800e-6, 250e-6, 50e-6])
  assert [r["share"] for r in t["top"]] == pytest.approx([800 / 1150, 250 / 1150, 50 / 1150])
  assert t["top_share"] == pytest.approx(1100 / 1150) and t["top_share"] < 1.0  # norm left out
  _check_table(t, k=3)
  # Every kernel in the table: the shares add up to 1.
  assert trace_top.top_table("p", events, k=10)["top_share"] == pytest.approx(1.0)
  empty = trace_top.top_table("p", [])
  assert empty["top"] == [] and empty["traced_ms"] == 0 and empty["top_share"] == 0
  assert len(trace_top.top_table("p", [("x" * 500, 1.0)])["top"][0]["name"]) == 200
  with pytest.raises(ValueError, match="k must be"):
    trace_top.top_table("p", events, k=0)
  with pytest.raises(ValueError, match="duration_ns of 'bad'"):
    trace_top.top_table("p", [("bad", -1.0)])
  with pytest.raises(ValueError, match="duration_ns of 'nan'"):
    trace_top.top_table("p", [("nan", float("nan"))])


def _plane(name, lines):
  ev = lambda name, start, dur, stats=(): types.SimpleNamespace(
      name=name, start_ns=start, duration_ns=dur, stats=list(stats))
  return types.SimpleNamespace(name=name, lines=[
      types.SimpleNamespace(name=ln, events=[ev(*e) for e in events]) for ln, events in lines])


def test_select_events_device_streams_then_host_ops():
  gpu = _plane("/device:GPU:0", [
      ("Stream #13(Kernel,MemcpyH2D)", [("graph", 0, 100), ("gemm", 10, 40), ("attn", 60, 30),
                                        ("MemcpyH2D", 200, 5)]),
      ("Stream #14(Kernel)", [("gemm", 0, 20)]),
      ("XLA Ops", [("fusion.1", 0, 1000)]),  # derived: left out where streams exist
      ("_counters_", [("power", 0, 0)])])
  host = _plane("/host:CPU", [("python3", [("step", 0, 10_000)])])
  plane, source, events = trace_top.select_events([host, gpu])
  # The CUDA graph's span holds two kernels: the kernels count, the span does not.
  assert (plane, source) == ("/device:GPU:0", "device")
  assert sorted(events) == [("MemcpyH2D", 5.0), ("attn", 30.0), ("gemm", 20.0), ("gemm", 40.0)]
  # No device events: the host's XLA ops (an "hlo_op" stat), innermost ones only.
  op = lambda name, start, dur: (name, start, dur, [("hlo_op", name)])
  host = _plane("/host:CPU", [
      ("tf_pool/1", [op("while", 0, 100), op("dot", 10, 30), op("tanh", 50, 20),
                     ("ThreadpoolListener::Record", 55, 0), op("copy", 200, 7)]),
      ("python3", [("$profiler.py trace", 0, 500)])])
  idle = _plane("/device:GPU:0", [("Stream #1", [])])
  plane, source, events = trace_top.select_events([idle, host])
  assert (plane, source) == ("/host:CPU", "host")
  assert sorted(events) == [("copy", 7.0), ("dot", 30.0), ("tanh", 20.0)]
  assert trace_top.select_events([]) == ("", "none", [])


def test_trace_top_reads_a_trace_and_says_why_not(monkeypatch):
  f = jax.jit(lambda x: jax.numpy.tanh(x @ x).sum())
  x = jax.numpy.ones((64, 64))
  f(x).block_until_ready()
  t = trace_top.trace_top(lambda: [f(x).block_until_ready() for _ in range(3)], k=4)
  assert t["status"] == "ok" and t["source"] == "host" and t["events"] >= 3, t
  _check_table(t, k=4)
  t = trace_top.trace_top(lambda: 1 / 0)
  assert t["status"] == "error" and "ZeroDivisionError" in t["error"]
  monkeypatch.delattr(jax.profiler, "ProfileData")
  t = trace_top.trace_top(lambda: None)
  assert t["status"] == "unavailable" and "jax.profiler.ProfileData" in t["reason"]


def test_torch_peer_checks_its_input_and_says_when_torch_is_missing(monkeypatch):
  hf = {"model_type": "llama"}
  with pytest.raises(ValueError, match="batches"):
    torch_peer.measure_generate(hf, batches=(), prompt_len=4, new_tokens=4, gpu=False)
  with pytest.raises(ValueError, match="prompt_len"):
    torch_peer.measure_generate(hf, batches=(1,), prompt_len=0, new_tokens=4, gpu=False)
  with pytest.raises(ValueError, match="new_tokens"):
    torch_peer.measure_generate(hf, batches=(1,), prompt_len=4, new_tokens=1, gpu=False)
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
  out = torch_peer.measure_generate(hf, batches=(1,), prompt_len=4, new_tokens=4, gpu=False)
  assert out["status"] == "skipped" and "not importable" in out["reason"]
