"""The H100 compile gate for quantized weights: the Engine's steps over fp8
and NVFP4 params compile for H100 (kernels Triton, weights kept in their
storage dtype as program arguments), and the fit verdicts use the real
quantized sizes (DeepSeek-V3/R1 FP8 does not fit 8 H100s, fits 16; NVFP4
fits 8)."""

import dataclasses

import pytest

from benchlib import gpu_plan
from jaxinfer import gpu_compile, presets
from jaxinfer.config import QuantConfig

SMALL = gpu_plan.Workload(batch=4, context=64, prefill_tokens=32)
EXPERTS = ("experts.w_gate", "experts.w_up", "experts.w_down")


def _plan(quant, mesh=None, layout="tp"):
  cfg = dataclasses.replace(presets.get("tiny_moe"), quant=quant)
  return gpu_plan.gpu_plan(model=cfg, mesh_axes=mesh or {"data": 1}, layout=layout, workload=SMALL)


def test_quantized_steps_compile_for_one_h100():
  plain = _plan(None)
  for quant in (QuantConfig(method="fp8", block=(128, 128)),
                QuantConfig(method="nvfp4", targets=EXPERTS)):
    r = _plan(quant)
    assert r["fit"]["fits"] and {p["name"] for p in r["programs"]} == {"decode", "mixed"}
    # Params are arguments in their storage dtypes: about half the bf16 bytes.
    assert r["params_bytes_per_device"] < 0.6 * plain["params_bytes_per_device"]
    for p, ref in zip(r["programs"], plain["programs"]):
      assert p["triton_kernels"] and p["fits"]
      # Projections (fp8) and experts (fp8, or NVFP4 packed 4-bit) go through
      # the per-tile dequantizing kernels.
      assert p["quantized_matmul_kernel"] == (quant.method == "fp8"), p["name"]
      assert p["quantized_grouped_kernel"], p["name"]
      # Dequantization happens where a layer reads its weights: the step's scratch
      # grows by far less than a bf16 copy of the params.
      extra = p["memory"]["temp_bytes"] - ref["memory"]["temp_bytes"]
      assert extra < 0.5 * plain["params_bytes_per_device"], (p["name"], extra)


def test_quantized_dp_attn_ep_step_compiles_for_eight_h100s():
  r = _plan(QuantConfig(method="fp8", block=(128, 128)), {"data": 2, "expert": 4}, "dp_attn_ep")
  assert r["fit"]["fits"]
  for p in r["programs"]:
    assert p["triton_kernels"] and p["collectives"]["ragged_all_to_all"] > 0, p["name"]
    # Per rank the weights are local: projections and experts go through the kernels.
    assert p["quantized_matmul_kernel"] and p["quantized_grouped_kernel"], p["name"]


# fp8 here; nvfp4's per-device kernels under tp: tests/kernels/test_kernels_quantized_matmul.py.
@pytest.mark.parametrize("quant", [QuantConfig(method="fp8", block=(1, 0))])
def test_tensor_parallel_quantized_weights_run_the_kernels_where_they_lie(quant):
  """Under tp the kernels run per device in shard_map on each weight's shard:
  the steps hold both kernels, and no quantized weight (and no kernel operand)
  is all-gathered."""
  r = _plan(quant, {"tensor": 2}, "tp")
  for p in r["programs"]:
    assert p["quantized_matmul_kernel"] and p["quantized_grouped_kernel"], p["name"]
    assert p["kernel_all_gathers"] == 0 and p["quantized_gathers"] == 0, p["name"]


@pytest.mark.parametrize("quant,devices,fits", [
    (QuantConfig(method="fp8", block=(128, 128)), 8, False),
    (QuantConfig(method="fp8", block=(128, 128)), 16, True),
    (QuantConfig(method="nvfp4"), 8, True),
    (None, 16, False)])
def test_deepseek_v3_fit_uses_quantized_sizes(quant, devices, fits):
  cfg = gpu_plan.gpu_config(dataclasses.replace(presets.get("deepseek_v3"), quant=quant), "bfloat16")
  mesh = gpu_compile.mesh({"data": devices // 8, "expert": 8})
  pb = gpu_plan.param_bytes(cfg, gpu_plan.abstract_params(cfg, mesh, "dp_attn_ep"))
  assert gpu_plan.fit_verdict(pb["all"], 0, 80e9)["fits"] == fits


@pytest.mark.parametrize("quant", [QuantConfig(method="fp8", block=(128, 128)),
                                   QuantConfig(method="nvfp4"), QuantConfig(method="mxfp4", targets=EXPERTS)])
def test_simulator_weight_bytes_are_the_spec_trees(quant):
  """The cluster simulator's weights per GPU equal the compiled plan's param
  bytes (quantized values, scales and the bf16 rest) within 1%."""
  from jaxinfer.sim.cost import Parallelism, RooflineCost, device
  cfg = dataclasses.replace(presets.get("deepseek_v3"), quant=quant)
  sim = RooflineCost(cfg=cfg, device=device("h100"), par=Parallelism(dp=8, ep=8), weight_dtype="bf16")
  g = gpu_plan.gpu_config(cfg, "bfloat16")
  pb = gpu_plan.param_bytes(g, gpu_plan.abstract_params(g, gpu_compile.mesh({"expert": 8}), "dp_attn_ep"))
  assert sim.weight_bytes_per_gpu() == pytest.approx(pb["all"], rel=0.01)
