"""The sharding report from shapes equals the bytes actually placed on 8 CPU devices,
scales to a 288-device abstract mesh, and rejects meshes the runtime rejects."""

import collections
import json
import math
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchlib.sharding_report import format_report, parse_mesh, sharding_report
from jaxinfer import models, presets, sharding
from jax.sharding import NamedSharding
from jaxinfer.kv.cache import init_pool
from jaxinfer.models import moe_ep, transformer

ROOT = pathlib.Path(__file__).parents[2]
CASES = [("tiny_dense", "tp", {"data": 4, "tensor": 2}),
         ("tiny_moe", "dp_attn_ep", {"data": 2, "expert": 4}),
         ("tiny_moe", "tp_attn_ep", {"tensor": 2, "expert": 4})]


def _max_bytes_per_device(tree) -> int:
  per = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per[shard.device] += shard.data.nbytes
  return max(per.values())


@pytest.mark.parametrize("model,layout,axes", CASES)
def test_bytes_equal_placed_shards(model, layout, axes):
  cfg = presets.get(model, dtype="float32")
  mesh = sharding.make_mesh(axes)
  report = sharding_report(model=model, mesh_axes=axes, layout=layout, dtype="float32",
                           kv_tokens=8 * 16)
  host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), models.abstract_params(cfg))
  params = sharding.shard_params(cfg, host, mesh, layout)
  assert report["params"]["per_device_bytes"] == _max_bytes_per_device(params)
  assert report["params"]["count"] == models.count_params(cfg)
  # The engine's pool: 8 pages of 16 tokens, sharded as the Engine shards it.
  pool = init_pool(cfg, 8, 16, np.float32,
                   sharding=NamedSharding(mesh, sharding.kv_pool_spec(cfg, mesh, layout)))
  assert report["kv"]["per_device_bytes"] == _max_bytes_per_device(pool)
  assert all(a["visualization"] for a in report["arrays"])  # the mesh fits the 8 devices


def test_deepseek_v3_on_288_devices_from_shapes():
  live = len(jax.live_arrays())  # from shapes: nothing of 671B parameters is allocated
  axes = {"data": 8, "expert": 36}
  r = sharding_report(model="deepseek_v3", mesh_axes=axes, layout="dp_attn_ep",
                      kv_tokens=1_000_000, redundant_experts=32)
  assert len(jax.live_arrays()) == live
  assert r["num_devices"] == 288 and r["physical_experts"] == 288
  routed = r["params"]["groups"]["routed_experts"]
  cfg = presets.get("deepseek_v3")
  n_moe = cfg.num_layers - len(cfg.dense_layers)
  assert routed["total_bytes"] == n_moe * 256 * 3 * cfg.d_model * cfg.moe_ffn_dim * 2
  # One expert (of 256 + 32 placed) per device: the placed routed bytes / 288.
  assert routed["per_device_bytes"] == pytest.approx(routed["total_bytes"] * 288 / 256 / 288)
  assert routed["per_device_bytes"] == pytest.approx(routed["total_bytes"] / 288, rel=0.13)
  assert all(a["visualization"] is None for a in r["arrays"])
  kv = r["kv"]  # MLA latent pool, pages split over the 288 attention-DP ranks
  tokens = -(-1_000_000 // 288) * 288
  assert kv["total_bytes"] == 61 * 576 * 2 * tokens
  assert kv["per_device_bytes"] == kv["total_bytes"] // 288
  ep = r["collectives"]["expert_parallel"]
  assert ep["size"] == 288 and ep["tokens_per_rank"] == 1 and ep["auto_strategy"] == "replicated"
  # Dispatch [n, C, D] per round, C = ceil(1.25 t k / n) = 1 row per destination
  # (it was t k = 8 rows, sized for every copy going to one rank).
  a2a = r["collectives"]["moe_alternative"]["moe"][0]
  assert ep["buffer_rows_per_dest"] == 1
  assert a2a["buffer_bytes"] == 288 * 1 * 7168 * 2
  assert "GiB/device" in format_report(r)
  # 256 experts without replicas on 256 devices: exactly total / 256.
  r256 = sharding_report(model="deepseek_v3", mesh_axes={"data": 8, "expert": 32},
                         layout="dp_attn_ep")
  g = r256["params"]["groups"]["routed_experts"]
  assert g["per_device_bytes"] * 256 == g["total_bytes"]


def test_bad_meshes_raise_naming_axis_and_dim():
  with pytest.raises(ValueError, match=r"kv_heads=2\) is not divisible by mesh axis tensor"):
    sharding_report(model="tiny_dense", mesh_axes={"tensor": 8}, layout="tp")
  with pytest.raises(ValueError, match=r"expert=256\) is not divisible by mesh axis "
                                       r"\('data', 'expert'\).*redundant_experts=32"):
    sharding_report(model="deepseek_v3", mesh_axes={"data": 8, "expert": 36}, layout="dp_attn_ep")
  with pytest.raises(ValueError, match=r"q_heads=128\) is not divisible by mesh axis tensor"):
    sharding_report(model="deepseek_v3", mesh_axes={"tensor": 3}, layout="tp_attn_ep")
  with pytest.raises(ValueError, match="unknown axis names"):
    sharding_report(model="tiny_dense", mesh_axes={"model": 2}, layout="tp")
  with pytest.raises(ValueError, match="name=size"):
    parse_mesh("data8")


def test_ep_all_to_all_matches_compiled_program():
  # The analytic per-MoE-layer all-to-alls equal those in the compiled program.
  # Compiled from sharded shapes (nothing allocated); per-layer collectives do not
  # depend on the depth, so 2 layers (1 dense, 1 MoE) stand in for tiny_moe's 4.
  cfg = presets.get("tiny_moe", dtype="float32", num_layers=2)
  axes, layout = {"data": 2, "expert": 4}, "dp_attn_ep"
  mesh = sharding.make_mesh(axes)
  params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        models.abstract_params(cfg), sharding.param_shardings(cfg, mesh, layout))
  tokens = jax.ShapeDtypeStruct((8, 64), np.int32,
                                sharding=sharding.batch_sharding(mesh, layout, 2))
  hlo = transformer._logits.lower(cfg, params, tokens, moe_ep.plan_from_params(params)) \
      .compile().as_text()
  compiled = []  # (dtype, elements summed over the tuple of per-destination buffers)
  for op in re.findall(r"= \((.*?)\) all-to-all\(", hlo):
    shapes = re.findall(r"\[([\d,]+)\]", op)
    compiled.append((re.match(r"(\w+)\[", op).group(1),
                     sum(math.prod(map(int, s.split(","))) for s in shapes)))
  compiled.sort()
  r = sharding_report(model="tiny_moe", mesh_axes=axes, layout=layout, dtype="float32",
                      batch_tokens=8 * 64)
  assert r["collectives"]["expert_parallel"]["auto_strategy"] == "all_to_all"
  names = {"float32": "f32", "int32": "s32", "bool": "pred"}
  analytic = sorted((names[c["dtype"]], math.prod(c["shape"]))
                    for c in r["collectives"]["per_layer"]["moe"] if c["op"] == "all_to_all")
  assert compiled == analytic


def test_experiment_script(tmp_path):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "sharding_report.py"), "--model", "deepseek_v3",
       "--mesh", "data=8,expert=36", "--layout", "dp_attn_ep", "--kv_tokens", "1000000",
       "--redundant_experts", "32", "--json_out", str(out)],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "GiB/device" in proc.stdout and "ANALYTIC" in proc.stdout
  data = json.loads(out.read_text())
  assert data["num_devices"] == 288 and data["collectives"]["analytic"] is True


def test_quantized_weights_use_their_real_sizes():
  """DeepSeek-V3 as shipped (block FP8) on 8 GPUs: about half the bf16 bytes,
  and over an H100's 80 GB where NVFP4 fits."""
  from benchlib import sharding_report as sr
  bf16 = sr.sharding_report(model="deepseek_v3", mesh_axes={"expert": 8}, layout="dp_attn_ep")
  fp8 = sr.sharding_report(model="deepseek_v3", mesh_axes={"expert": 8}, layout="dp_attn_ep",
                           quant="fp8")
  nvfp4 = sr.sharding_report(model="deepseek_v3", mesh_axes={"expert": 8}, layout="dp_attn_ep",
                             quant="nvfp4")
  per_dev = lambda r: r["params"]["per_device_bytes"]
  assert 0.5 < per_dev(fp8) / per_dev(bf16) < 0.52  # embeddings, norms, routers stay bf16
  assert per_dev(fp8) > 80e9 > per_dev(nvfp4)
  assert fp8["quant"] == "fp8" and "weights=fp8" in sr.format_report(fp8)
  assert fp8["arrays"][-2]["name"].endswith(".values")  # the expert w_gate, stored quantized
