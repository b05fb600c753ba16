"""hlo_report reads a compiled GPU step's cost off its optimized HLO: kernel
launches (while bodies times their trip counts), bytes of weight copies, and
loops without a known trip count. Checked on a small HLO module written here
(every rule once), then on the Engine's real llama3_8b step compiled for an
H100 by gpu_plan (--num_layers, --hlo_dir): scanned stacked layers copy each
layer's weights out of the stack, per-layer weights (the GPU Engine's
default form) copy none, also for a DeepSeek-V3 slice under attention DP;
and the per-layer llama3_8b decode step at batch 1 and 64 within 14
launches a layer (`gpu_plan.decode_budget`), on both jax lines CI runs."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from benchlib import gpu_plan, hlo_report
from jaxinfer import EngineConfig, gpu_compile, presets
from jaxinfer.engine import weight_layout
from jaxinfer.models.layouts import WeightForm

# Entry: a 4 MiB weight transposed whole (a copy: 4 MiB), a 16-byte embedding
# row looked up (a read), then a loop of 3 trips whose body copies a 2 MiB
# slice of the stacked weight (async fusion-start / -done) and multiplies with
# it (a gemm fusion, not a copy), and a loop with no known trip count.
HLO = """HloModule jit_step, is_scheduled=true

%fused_slice (param_0: bf16[3,1024,1024], param_1: s32[]) -> bf16[1,1024,1024] {
  %param_0 = bf16[3,1024,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,1024,1024}
}

%gemm (param_0.1: bf16[8,1024], param_1.1: bf16[1,1024,1024]) -> f32[8,1024] {
  %param_0.1 = bf16[8,1024]{1,0} parameter(0)
  %param_1.1 = bf16[1,1024,1024]{2,1,0} parameter(1)
  %b = bf16[1024,1024]{1,0} bitcast(%param_1.1)
  ROOT %dot = f32[8,1024]{1,0} dot(%param_0.1, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%transpose_comp (param_0.2: bf16[2048,1024]) -> bf16[1024,2048] {
  %param_0.2 = bf16[2048,1024]{1,0} parameter(0)
  ROOT %t = bf16[1024,2048]{1,0} transpose(%param_0.2), dimensions={1,0}
}

%row (param_0.3: bf16[100,8], param_1.3: s32[]) -> bf16[1,8] {
  %param_0.3 = bf16[100,8]{1,0} parameter(0)
  %param_1.3 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %r = bf16[1,8]{1,0} dynamic-slice(%param_0.3, %param_1.3, %z), dynamic_slice_sizes={1,8}
}

%body (arg: (s32[], bf16[8,1024], bf16[3,1024,1024])) -> (s32[], bf16[8,1024], bf16[3,1024,1024]) {
  %arg = (s32[], bf16[8,1024]{1,0}, bf16[3,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[8,1024]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[3,1024,1024]{2,1,0} get-tuple-element(%arg), index=2
  %fusion-start = ((bf16[3,1024,1024]{2,1,0}, s32[]), bf16[1,1024,1024]{2,1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%fused_slice
  %fusion-done = bf16[1,1024,1024]{2,1,0} fusion-done(%fusion-start)
  %y = f32[8,1024]{1,0} fusion(%x, %fusion-done), kind=kCustom, calls=%gemm
  %y16 = bf16[8,1024]{1,0} convert(%y)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[8,1024]{1,0}, bf16[3,1024,1024]{2,1,0}) tuple(%next, %y16, %w)
}

%cond (arg.1: (s32[], bf16[8,1024], bf16[3,1024,1024])) -> pred[] {
  %arg.1 = (s32[], bf16[8,1024]{1,0}, bf16[3,1024,1024]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

%body2 (arg.2: (s32[])) -> (s32[]) {
  %arg.2 = (s32[]) parameter(0)
  %j = s32[] get-tuple-element(%arg.2), index=0
  %j1 = s32[] add(%j, %j)
  ROOT %o2 = (s32[]) tuple(%j1)
}

%cond2 (arg.3: (s32[])) -> pred[] {
  %arg.3 = (s32[]) parameter(0)
  %j.3 = s32[] get-tuple-element(%arg.3), index=0
  %k = s32[] constant(100)
  ROOT %lt2 = pred[] compare(%j.3, %k), direction=LT
}

ENTRY %main (params__layers__.1: bf16[3,1024,1024], params__proj__.1: bf16[2048,1024], params__embed__.1: bf16[100,8], x.1: bf16[8,1024], tok.1: s32[]) -> bf16[8,1024] {
  %params__layers__.1 = bf16[3,1024,1024]{2,1,0} parameter(0)
  %params__proj__.1 = bf16[2048,1024]{1,0} parameter(1)
  %params__embed__.1 = bf16[100,8]{1,0} parameter(2)
  %x.1 = bf16[8,1024]{1,0} parameter(3)
  %tok.1 = s32[] parameter(4)
  %wrapped_transpose = bf16[1024,2048]{1,0} fusion(%params__proj__.1), kind=kInput, calls=%transpose_comp
  %row_fusion = bf16[1,8]{1,0} fusion(%params__embed__.1, %tok.1), kind=kLoop, calls=%row
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,1024]{1,0}, bf16[3,1024,1024]{2,1,0}) tuple(%zero, %x.1, %params__layers__.1)
  %while.1 = (s32[], bf16[8,1024]{1,0}, bf16[3,1024,1024]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %init2 = (s32[]) tuple(%zero)
  %while.2 = (s32[]) while(%init2), condition=%cond2, body=%body2
  ROOT %res = bf16[8,1024]{1,0} get-tuple-element(%while.1), index=1
}
"""


def test_the_rules_on_a_small_module():
  r = hlo_report.read(HLO)
  copies = {name.split("/")[-1]: (b, times) for name, b, times in r.weight_copies}
  # The whole projection transposed once, one layer's slice copied each trip;
  # the embedding row is a read, the gemm reads the copy.
  assert copies == {"wrapped_transpose": (4 << 20, 1), "fusion-start": (2 << 20, 3)}, copies
  assert r.weight_copy_bytes == (4 << 20) + 3 * (2 << 20)
  # Entry: transpose, row lookup = 2; body (x3): fusion-start, gemm, convert, add = 4;
  # the unknown loop: body (add) once + its condition (compare) once.
  assert r.launches == 2 + 3 * 4 + 2, r.launches
  assert r.loops == 2 and r.unknown_trip_loops == ("while.2",)
  assert r.as_dict(2)["launches_per_layer"] == 8.0
  # With no weight arguments there is nothing to copy.
  assert hlo_report.read(HLO, weights=lambda param: False).weight_copy_bytes == 0


def test_weights_are_known_by_name_or_by_path_after_spmd_renaming():
  def param(line):
    [comp] = hlo_report.parse("ENTRY %m (p: f32[2]) -> f32[2] {\n" + line + "\n}\n").values()
    return comp.instrs[0]
  named = param("  %params__layers___0___attn____wo__.1 = bf16[3,8]{1,0} parameter(3)")
  spmd = param("  %param.63 = bf16[3,8]{1,0} parameter(6), "
               "metadata={op_name=\"params[\\'layers\\'][0][\\'attn\\'][\\'wo\\']\"}")
  pool = param("  %param.90 = bf16[1,4097]{1,0} parameter(33), "
               "metadata={op_name=\"pool.segments[1][\\'kv\\']\"}")
  assert [hlo_report.param_weights(p) for p in (named, spmd, pool)] == [True, True, False]


def test_array_bytes_reads_tuples_and_sub_byte_types():
  assert hlo_report.array_bytes("(bf16[2,3]{1,0}, f32[4])") == 12 + 16
  assert hlo_report.array_bytes("f4e2m1fn[16]{0}") == 8
  assert hlo_report.array_bytes("pred[]") == 1


def _layer_weight_bytes(stacked) -> set[int]:
  """Bytes of one layer's slice of each stacked weight."""
  return {a.size // a.shape[0] * a.dtype.itemsize for a in jax.tree.leaves(stacked["layers"])}


def test_llama_step_scanned_copies_layer_weights_and_per_layer_weights_copy_none(tmp_path):
  # gpu_plan's report and HLO files for llama3_8b cut to 2 layers, batch 1.
  w = gpu_plan.Workload(batch=1, context=256, prefill_tokens=16)
  report = gpu_plan.gpu_plan(model="llama3_8b", mesh_axes={"data": 1}, layout="tp",
                             workload=w, num_layers=2, hlo_dir=str(tmp_path), weights="stacked")
  assert report["num_layers"] == 2
  decode = next(p for p in report["programs"] if p["name"] == "decode")
  assert (tmp_path / "decode.hlo").exists() and (tmp_path / "mixed.hlo").exists()
  hlo = decode["hlo"]
  # Scanned: XLA copies layer weights out of the stack (how many depends on
  # the jax line); every copy in the loop is one layer's slice of a weight.
  cfg = gpu_plan.gpu_config(gpu_plan.with_layers(presets.get("llama3_8b"), 2), "bfloat16")
  mesh = gpu_compile.mesh({"data": 1})
  stacked = gpu_plan.abstract_params(cfg, mesh, "tp")
  in_loop = [c for c in hlo["weight_copies"] if c["times"] == 2]
  assert hlo["weight_copy_bytes"] > 0 and in_loop, json.dumps(hlo)[:2000]
  assert {c["bytes"] for c in in_loop} <= _layer_weight_bytes(stacked), in_loop
  assert hlo["loops"] >= 1 and not hlo["unknown_trip_loops"]
  assert 10 < hlo["launches_per_layer"] < 200
  # The same step over per-layer weights, as EngineConfig(unroll_layers=True)
  # holds them on a GPU, reads them in place.
  per_layer = gpu_plan.gpu_plan(model="llama3_8b", mesh_axes={"data": 1}, layout="tp",
                                workload=w, num_layers=2, weights="per_layer")
  assert per_layer["weights"] == "per_layer"
  for p in per_layer["programs"]:
    assert p["hlo"]["weight_copy_bytes"] == 0, (p["name"], p["hlo"]["weight_copies"])
  unrolled = next(p for p in per_layer["programs"] if p["name"] == "decode")["hlo"]
  assert unrolled["loops"] < hlo["loops"]
  assert unrolled["launches_per_layer"] < hlo["launches_per_layer"]


def test_deepseek_slice_under_attention_dp_reads_per_layer_weights_in_place():
  """One dense and one MoE layer of DeepSeek-V3, dp_attn_ep on 8 H100s (the
  experts split over every device, the step per rank in shard_map): per-layer
  weights placed where the Engine's load puts them compile with no copies."""
  cfg = gpu_plan.gpu_config(presets.get("deepseek_v3", num_layers=2, num_mtp_layers=0,
                                        dense_layers=(0,)), "bfloat16")
  mesh = gpu_compile.mesh({"data": 8})
  w = gpu_plan.Workload(batch=4, context=64)
  params, ep = gpu_plan.engine_params(cfg, mesh, "dp_attn_ep", "per_layer")
  assert ep is not None and isinstance(params["layers"][1], tuple)
  pool = gpu_plan.abstract_pool(cfg, mesh, "dp_attn_ep", w.pool_pages(), w.page_size)
  lowered, _ = gpu_plan.lower_step(cfg, params, pool, mesh, "dp_attn_ep", [(1, w.context)] * 4,
                                   w, ep=ep)
  entry = gpu_plan.compile_program(lowered, 80e9, pool, num_layers=2)
  assert entry["hlo"]["weight_copy_bytes"] == 0, entry["hlo"]["weight_copies"]
  assert entry["collectives"]["ragged_all_to_all"] + entry["collectives"]["all_to_all"] > 0
  assert entry["fits"] and not entry["hlo"]["unknown_trip_loops"]


def test_a_gpu_engine_unrolls_by_default_into_the_gpu_form():
  cfg = presets.get("tiny_moe")
  small = {"layers": [jnp.zeros((2, 8), jnp.float32)]}
  big = {"layers": [jnp.zeros((2, 8 << 20), jnp.float32)]}  # 64 MiB of layer weights
  gpu_form = WeightForm(fused_qkv=True)
  # On a GPU the default unrolls whatever the size, into per-layer arrays as
  # loaded with q, k and v fused by KV head; False keeps the scan.
  for params in (small, big):
    assert weight_layout.choose(cfg, EngineConfig(), params, backend="gpu") == gpu_form
    assert weight_layout.choose(cfg, EngineConfig(unroll_layers=True), params,
                                backend="gpu") == gpu_form
  assert weight_layout.choose(cfg, EngineConfig(unroll_layers=False), big, backend="gpu") is None
  # The CPU unrolls from 64 MiB of layers, into its own forms.
  assert weight_layout.choose(cfg, EngineConfig(), small, backend="cpu") is None
  cpu = weight_layout.choose(cfg, EngineConfig(cpu_weight_layout="in_out"), big, backend="cpu")
  assert cpu is not None and not cpu.fused_qkv


@pytest.mark.parametrize("batch", [1, 64])
def test_llama3_8b_decode_fits_the_launch_budget_and_copies_no_weight(batch):
  """The Engine's GPU decode step for llama3_8b on one H100, compiled at 2
  and 3 layers: each layer adds the same launches, so the 32-layer step's
  launches a layer follow (`gpu_plan.decode_budget`); at most 14, no weight
  copied, every loop's trip count known."""
  r = gpu_plan.decode_budget("llama3_8b", batch=batch, context=1024)
  assert r["num_layers"] == 32 and r["launches"][3] - r["launches"][2] == r["per_layer"]
  assert r["weight_copy_bytes"] == 0 and not r["unknown_trip_loops"], r
  assert r["launches_per_layer"] <= 14, r
  assert r["per_layer"] >= 8, r  # norm, QKV, cache writes, attention, o, norm, MLP: a floor


def test_with_layers_keeps_the_dense_first_layers():
  ds = presets.get("deepseek_v3")
  four = gpu_plan.with_layers(ds, 4)
  assert four.num_layers == 4 and four.dense_layers == tuple(i for i in ds.dense_layers if i < 4)
  assert dataclasses.replace(four, num_layers=ds.num_layers, dense_layers=ds.dense_layers) == ds
  for bad in (0, ds.num_layers + 1, 2.0):
    try:
      gpu_plan.with_layers(ds, bad)
    except ValueError as e:
      assert "num_layers" in str(e)
    else:
      raise AssertionError(bad)
