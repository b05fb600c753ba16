"""The GPU compile gate for the Engine's steps: plain decode, mixed prefill +
decode, speculative MTP, the attention-DP `shard_map` step with expert
parallelism and the Qwen3-VL image step (with its vision encoder) are
compiled into H100 executables on this CPU machine from abstract params
(`benchlib.gpu_plan`), with the config's backend target set to "gpu":
the compiled HLO must hold the Pallas Triton kernels, not the XLA
fallback. Also the Backend target contract and gpu_plan's fit verdicts."""

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import FIXTURES
from benchlib import gpu_plan, sharding_report
from jaxinfer import Backend, gpu_compile, ops, presets, sharding
from jaxinfer.config import ModelConfig
from jaxinfer.engine import sampling_extras, steps
from jaxinfer.engine.steps import Ranks
from jaxinfer.models import vision
from jaxinfer.models.moe_ep import plan_from_params
from pallas_kernels import mosaic_paged_attention as mpa

RESULTS = pathlib.Path(__file__).parents[2] / "experiments" / "results"
SMALL = gpu_plan.Workload(batch=4, context=64, prefill_tokens=32)


def _ragged(page_size, target, implementation=None, D=64):
  """ops.ragged_paged_attention compiled for one H100 -> HLO text."""
  mesh = gpu_compile.mesh({"data": 1})
  S = lambda shape, d=jnp.bfloat16: jax.ShapeDtypeStruct(shape, d,
                                                         sharding=NamedSharding(mesh, P()))
  B, pages = 4, 8
  args = (S((8, 4, D)), S((2, 64, page_size, D)), S((2, 64, page_size, D)),
          S((B,), jnp.int32), S((B, pages), jnp.int32), S((B + 1,), jnp.int32))

  def fn(q, kp, vp, kv_lens, table, cu):
    kv = ops.PagedKV(k_pages=kp, v_pages=vp, kv_lens=kv_lens, page_table=table, cu_q_lens=cu,
                     max_q=2)
    return ops.ragged_paged_attention(ops.AttentionCall(q=q, kv=kv, scale=0.125),
                                      Backend(attention=implementation, target=target))
  with gpu_compile.lowering(mesh):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_gpu_target_compiles_the_kernel_in_a_cpu_process():
  assert jax.default_backend() == "cpu"
  # Outside a lowering for an H100 this CPU process targets no Hopper: Triton.
  assert Backend(target="gpu").attention_kernel() == ("pallas", False)
  # For an H100 the default is Mosaic GPU where this jax has it (>= 0.11), else Triton.
  auto = _ragged(16, "gpu")
  mosaic = mpa.available() is None
  assert (gpu_plan.MOSAIC_CALL in auto) == mosaic and (gpu_plan.TRITON_CALL in auto) != mosaic
  assert gpu_plan.TRITON_CALL in _ragged(16, "gpu", implementation="pallas")
  assert gpu_plan.TRITON_CALL not in _ragged(16, "cpu")  # XLA path
  assert gpu_plan.TRITON_CALL not in _ragged(16, None)  # this process: CPU


def test_untileable_shapes_fall_back_to_xla_unless_pallas_is_explicit():
  # page size 12: not a power of two, so the Triton kernel cannot tile it.
  assert gpu_plan.TRITON_CALL not in _ragged(12, "gpu")
  assert gpu_plan.TRITON_CALL not in _ragged(16, "gpu", D=8)  # head dim below a tile
  with pytest.raises(ValueError, match="cannot tile"):
    _ragged(12, "gpu", implementation="pallas")


def test_paged_tiling_from_shapes():
  tiling = lambda *a, **kw: {k: v for k, v in ops.paged_tiling(*a, **kw).items()
                             if k in ("pages_per_compute_block", "num_splits", "num_warps")}
  assert tiling(64, 8, 512, 16) == dict(pages_per_compute_block=4, num_splits=1, num_warps=4)
  assert tiling(1, 1, 2048, 16) == dict(pages_per_compute_block=4, num_splits=8, num_warps=4)
  assert tiling(32, 1, 64, 64) == dict(pages_per_compute_block=1, num_splits=6, num_warps=4)
  assert tiling(2, 1, 4, 16)["num_splits"] == 1  # one page block per sequence
  # MLA, 128 heads a rank: 2 row blocks; the f32 partials cap split-K at 1; 8 warps.
  assert tiling(32, 1, 128, 64, num_q_heads=128, head_dim=576, value_dim=512,
                values_from_keys=True) == dict(pages_per_compute_block=1, num_splits=1,
                                               num_warps=8)


def test_bad_backend_target_raises_naming_the_field():
  with pytest.raises(ValueError, match="Backend.target"):
    presets.get("tiny_dense", backend=Backend(target="tpu"))
  with pytest.raises(ValueError, match="target"):
    Backend(target="cuda")
  cfg = presets.get("tiny_dense", backend=Backend(target="gpu"))
  assert hash(cfg) != hash(presets.get("tiny_dense"))  # a distinct static jit argument


def _plan(model, mesh, layout, hosts=1, workload=SMALL, **kw):
  report = gpu_plan.gpu_plan(model=model, mesh_axes=mesh, layout=layout, hosts=hosts,
                             workload=workload, **kw)
  assert report["fit"]["fits"], report["fit"]
  return {p["name"]: p for p in report["programs"]}, report


def _check(program, max_gathers=0):
  # the real kernels, not XLA: Triton, or on jax >= 0.11 Mosaic GPU (an H100's default)
  assert program["triton_kernels"] or program["mosaic_kernels"], program["name"]
  assert program["kernel_all_gathers"] <= max_gathers, program["name"]
  assert 0 < program["peak_bytes"] < 80e9 and program["fits"]
  assert program["cost"]["flops"] > 0 and program["roofline"]["step_s"] > 0


def test_dense_steps_compile_for_one_h100():
  programs, report = _plan("tiny_dense", {"data": 1}, "tp")
  assert set(programs) == {"decode", "mixed"}
  for p in programs.values():
    _check(p)
  assert programs["decode"]["shapes"]["max_q"] == 1
  assert programs["mixed"]["shapes"]["max_q"] == 32
  # The pool and params are arguments: nothing is allocated, bytes come from shapes.
  m = programs["decode"]["memory"]
  assert m["argument_bytes"] >= report["params_bytes_per_device"] + report["kv_bytes_per_device"]


def test_mla_moe_and_speculative_steps_compile_for_one_h100():
  w = dataclasses.replace(SMALL, num_draft_tokens=2)
  programs, _ = _plan("tiny_moe", {"data": 1}, "tp", workload=w)
  assert set(programs) == {"decode", "mixed", "speculative K=2"}
  for p in programs.values():
    _check(p)
  assert programs["speculative K=2"]["shapes"]["max_q"] == 4  # K + 1 rounded up


@pytest.mark.parametrize("model,kind", [("tiny_dense", "fp8"), ("tiny_moe", "fp8"),
                                        ("tiny_dense", "int8")])
def test_quantized_kv_steps_compile_for_one_h100(model, kind):
  # EngineConfig(kv_cache_dtype=...): the kernels read 1-byte pages (GQA k/v,
  # MLA's latent) with per-layer scales, arguments of the step (not constants).
  w = dataclasses.replace(SMALL, kv_cache_dtype=kind)
  programs, report = _plan(model, {"data": 1}, "tp", workload=w)
  _, bf16 = _plan(model, {"data": 1}, "tp", workload=dataclasses.replace(w, kv_cache_dtype=None))
  assert set(programs) == {"decode", "mixed"}
  for p in programs.values():
    _check(p)
  # Pages at half the bf16 bytes (the per-layer scales add bytes, not per page).
  assert 0 < report["kv_bytes_per_device"] - bf16["kv_bytes_per_device"] / 2 < 1024
  decode = gpu_plan.lower_step(
      gpu_plan.gpu_config(presets.get(model), "bfloat16"), *_abstract(model, w),
      [(1, w.context)] * w.batch, w)[0]
  text = decode.as_text()
  assert ("f8E4M3FN" if kind == "fp8" else "xi8") in text


def test_fp8_kv_dp_attn_ep_and_speculative_steps_compile_for_eight_h100s():
  # The ranked shard_map steps (plain and MTP) over a page-split fp8 pool,
  # its scales replicated on every rank.
  w = dataclasses.replace(SMALL, num_draft_tokens=2, kv_cache_dtype="fp8")
  programs, _ = _plan("tiny_moe", {"data": 2, "expert": 4}, "dp_attn_ep", workload=w)
  assert set(programs) == {"dp_attn_ep decode", "dp_attn_ep mixed",
                           "dp_attn_ep speculative K=2"}
  for p in programs.values():
    _check(p)


def _abstract(model, w):
  cfg = model if isinstance(model, ModelConfig) else gpu_plan.gpu_config(presets.get(model),
                                                                         "bfloat16")
  mesh = gpu_compile.mesh({"data": 1})
  params = gpu_plan.abstract_params(cfg, mesh, "tp")
  pool = gpu_plan.abstract_pool(cfg, mesh, "tp", w.pool_pages(), w.page_size,
                                kv_cache_dtype=w.kv_cache_dtype)
  return params, pool, mesh, "tp"


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_multi_step_decode_compiles_for_one_h100(model):
  # EngineConfig(decode_steps=4): four decode steps in one program (a loop
  # over the step, pool and samples carried), with the paged Triton kernel.
  params, pool, mesh, layout = _abstract(model, SMALL)
  cfg = gpu_plan.gpu_config(presets.get(model), "bfloat16")
  seqs = [(1, SMALL.context)] * SMALL.batch
  lowered, shapes = gpu_plan.lower_decode_steps(cfg, params, pool, mesh, layout, seqs, SMALL, 4)
  assert lowered.out_info[0].shape == (4, 1, shapes.seqs) and shapes.max_q == 1  # [steps, ranks, S]
  compiled = lowered.compile()
  text = compiled.as_text()
  assert gpu_plan.TRITON_CALL in text and "while" in text
  memory = gpu_compile.MemoryReport.of(compiled)
  pool_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(pool))
  assert memory.alias_bytes >= pool_bytes  # the donated pool is updated in place
  assert 0 < memory.peak_bytes < 80e9


def test_multi_step_decode_with_sampling_extras_compiles_for_one_h100():
  # Requests with penalties, logit_bias or min_tokens: the loop builds the
  # token counts [B, V] once and adds each step's samples (`sampling_extras`).
  params, pool, mesh, layout = _abstract("tiny_dense", SMALL)
  cfg = gpu_plan.gpu_config(presets.get("tiny_dense"), "bfloat16")
  B, ints, floats = SMALL.batch, np.zeros(SMALL.batch, np.int32), np.ones(SMALL.batch, np.float32)
  extras = sampling_extras.Extras(
      bias=sampling_extras.Bias(np.zeros((B, 8), np.int32), np.zeros((B, 8), np.float32),
                                np.zeros((B, 8), np.int32)),
      penalties=sampling_extras.Penalties(np.zeros((B, 64), np.int32), ints, ints, ints, floats,
                                          floats, floats, in_flight=np.zeros((4, B), np.int32)))
  lowered, shapes = gpu_plan.lower_decode_steps(cfg, params, pool, mesh, layout,
                                                [(1, SMALL.context)] * B, SMALL, 4, extras)
  assert shapes.seqs == B and lowered.out_info[0].shape == (4, 1, B)  # [steps, ranks, S]
  text = lowered.compile().as_text()
  assert gpu_plan.TRITON_CALL in text and "while" in text


def test_multi_step_decode_under_attention_dp_compiles_for_eight_h100s():
  # decode_steps=4 with dp_attn_ep: the ranked shard_map step in the loop,
  # routed rows moved with ragged all-to-alls as in the single step.
  mesh = gpu_compile.mesh({"data": 2, "expert": 4})
  cfg = gpu_plan.gpu_config(presets.get("tiny_moe"), "bfloat16")
  params = gpu_plan.abstract_params(cfg, mesh, "dp_attn_ep")
  pool = gpu_plan.abstract_pool(cfg, mesh, "dp_attn_ep", SMALL.pool_pages(), SMALL.page_size)
  seqs = [(1, SMALL.context)] * SMALL.batch
  lowered, shapes = gpu_plan.lower_decode_steps(cfg, params, pool, mesh, "dp_attn_ep", seqs,
                                                SMALL, 4)
  assert lowered.out_info[0].shape == (4, 8, shapes.seqs)  # [steps, ranks, S]
  text = lowered.compile().as_text()
  assert gpu_plan.TRITON_CALL in text and "while" in text
  assert any(kind == "ragged-all-to-all" for kind, _ in gpu_plan.collective_ops(text))


def test_qwen3_vl_image_step_and_encoder_compile_for_one_h100():
  # The Engine's image step: `steps.step` with visual rows (`images.step_visual`:
  # MRoPE [1, 3, T], embeddings [1, T, D] where mask [1, T], DeepStack [1, k, T, D]) for a
  # prefill chunk inside an image next to decodes; and the vision tower
  # (`vision.encode`, jitted on its own per image grid), bf16 on an H100.
  hf = json.loads((FIXTURES / "hf_vl" / "qwen3_vl" / "config.json").read_text())
  cfg = gpu_plan.gpu_config(ModelConfig.from_hf(hf), "bfloat16")
  params, pool, mesh, _ = _abstract(cfg, SMALL)
  seqs = [(SMALL.prefill_tokens, SMALL.prefill_tokens)] + [(1, SMALL.context)] * (SMALL.batch - 1)
  batch, shapes = gpu_plan.host_batch(seqs, SMALL.page_size, SMALL.pages_per_seq(), len(seqs))
  T, D, k = shapes.tokens, cfg.d_model, len(cfg.vision.deepstack_indexes)
  rep = NamedSharding(mesh, P())
  S = lambda shape, d: jax.ShapeDtypeStruct((1, *shape), d, sharding=rep)  # one rank
  visual = dict(rope=S((3, T), jnp.int32), embeds=S((T, D), jnp.float32),
                mask=S((T,), jnp.bool_), deepstack=S((k, T, D), jnp.float32))
  compiled = {}
  for name, rows in (("text", None), ("image", visual)):
    with gpu_compile.lowering(mesh):
      lowered = steps.step.lower(
          steps.StepModel(cfg, params), steps.StepState(pool),
          steps.StepInputs(gpu_compile.abstract(steps.stack_batches([batch]), rep),
                           S((shapes.seqs,), jnp.int32), visual=rows),
          steps.Program(steps.Plain(), max_q=shapes.max_q, greedy=True))
    compiled[name] = lowered.compile()
  text, image = (gpu_compile.MemoryReport.of(compiled[n]) for n in ("text", "image"))
  assert gpu_plan.TRITON_CALL in compiled["image"].as_text()  # the paged kernel, not XLA
  assert 0 < image.peak_bytes < 80e9
  # The image step takes the visual rows on top of the text step's arguments,
  # less the text step's rotary positions (it rotates by the rows' MRoPE, and
  # jit drops an unused argument).
  rows_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in visual.values())
  assert image.argument_bytes - text.argument_bytes == rows_bytes - batch.rope_positions.nbytes
  vc, grid = cfg.vision, ((1, 4, 6),)  # 24 patches -> 6 visual tokens
  with gpu_compile.lowering(mesh):
    encoder = vision.encode.lower(
        vc, params["vision"], jax.ShapeDtypeStruct((24, vc.patch_dim), jnp.float32, sharding=rep),
        grid).compile()
  m = gpu_compile.MemoryReport.of(encoder)
  assert m.argument_bytes > 0 and 0 < m.peak_bytes < 80e9
  shapes_out = [o.shape for o in jax.tree.leaves(encoder.out_info)]
  assert shapes_out == [(6, D), (k, 6, D)]


def test_qwen3_vl_moe_image_step_under_attention_dp_compiles_for_four_h100s():
  # Images under attention DP: `steps.step` run per rank with each rank's visual
  # rows ([n, ...], `Images.step_visual`), Qwen3-VL-MoE (4 experts) on data=2 x expert=2 H100s.
  hf = json.loads((FIXTURES / "hf_vl" / "qwen3_vl_moe" / "config.json").read_text())
  cfg = gpu_plan.gpu_config(ModelConfig.from_hf(hf), "bfloat16")
  mesh, layout = gpu_compile.mesh({"data": 2, "expert": 2}), "dp_attn_ep"
  params = gpu_plan.abstract_params(cfg, mesh, layout)
  pool = gpu_plan.abstract_pool(cfg, mesh, layout, SMALL.pool_pages(), SMALL.page_size)
  axes = sharding.dp_axes(mesh, layout)
  n = math.prod(mesh.shape[a] for a in axes)
  seqs = [(SMALL.prefill_tokens, SMALL.prefill_tokens)] + [(1, SMALL.context)] * (SMALL.batch - 1)
  batch, shapes = gpu_plan.host_batch(seqs, SMALL.page_size, SMALL.pages_per_seq(), len(seqs))
  split = NamedSharding(mesh, P(axes))
  S = lambda shape, d: jax.ShapeDtypeStruct((n, *shape), d, sharding=split)
  T, D, k = shapes.tokens, cfg.d_model, len(cfg.vision.deepstack_indexes)
  visual = dict(rope=S((3, T), jnp.int32), embeds=S((T, D), jnp.float32),
                mask=S((T,), jnp.bool_), deepstack=S((k, T, D), jnp.float32))
  ranked = gpu_compile.abstract(steps.stack_batches([batch] * n), split)
  with gpu_compile.lowering(mesh):
    compiled = steps.step.lower(
        steps.StepModel(cfg, params, plan_from_params(params), Ranks.of(params, mesh, axes)),
        steps.StepState(pool),
        steps.StepInputs(ranked, S((shapes.seqs,), jnp.int32), visual=visual),
        steps.Program(steps.Plain(), max_q=shapes.max_q, greedy=True)).compile()
  assert n == 4 and gpu_plan.TRITON_CALL in compiled.as_text()
  assert 0 < gpu_compile.MemoryReport.of(compiled).peak_bytes < 80e9


def test_steps_compile_for_eight_h100s():
  programs, _ = _plan("tiny_dense", {"data": 4, "tensor": 2}, "tp")
  for p in programs.values():
    # The kernel runs per head shard in shard_map: no gather of the pool around it.
    _check(p)
    assert p["collectives"]["all_reduce"] > 0  # tensor-parallel partial sums


def test_dp_attn_ep_shard_map_step_with_expert_all_to_all_for_eight_h100s():
  programs, report = _plan("tiny_moe", {"data": 2, "expert": 4}, "dp_attn_ep",
                           workload=dataclasses.replace(SMALL, num_draft_tokens=2))
  # MTP under attention DP: the speculative step runs whole per rank.
  assert set(programs) == {"dp_attn_ep decode", "dp_attn_ep mixed",
                           "dp_attn_ep speculative K=2"}
  for p in programs.values():
    _check(p)  # attention runs per rank in shard_map: no pool gathers
    assert p["ranks"] == 8
  # On a GPU target the copies go out with ragged all-to-alls (exactly the
  # routed rows), at decode batches as in mixed steps.
  for name in ("dp_attn_ep decode", "dp_attn_ep mixed", "dp_attn_ep speculative K=2"):
    assert programs[name]["collectives"]["ragged_all_to_all"] > 0, name
    assert programs[name]["collectives"]["all_to_all"] == 0, name


def test_multi_host_topology_compiles():
  cfg = presets.get("tiny_moe", num_experts=32)  # one expert per device
  programs, report = _plan(cfg, {"data": 4, "expert": 8}, "dp_attn_ep", hosts=4)
  assert report["devices"] == 32 and report["devices_per_host"] == 8
  for p in programs.values():
    _check(p)


def test_seed_scale_llama8b_decode_on_one_h100():
  w = gpu_plan.Workload(batch=8, context=1024, prefill_tokens=128)
  # Stacked: the same fit and kernels, and seconds to compile where the 32
  # layers unrolled take minutes (test_hlo_report holds the per-layer step).
  programs, report = _plan("llama3_8b", {"data": 1}, "tp", workload=w, weights="stacked")
  _check(programs["decode"])
  assert 15e9 < report["params_bytes_per_device"] < 17e9  # 8.0B params in bf16
  # Decode at batch 8 is bound by reading the weights.
  assert programs["decode"]["roofline"]["bound"] == "memory"


def test_llama405b_tp8_bf16_does_not_fit():
  report = gpu_plan.gpu_plan(model="llama3_1_405b", mesh_axes={"tensor": 8}, layout="tp")
  assert not report["fit"]["fits"] and report["programs"] == []
  assert "params do not fit" in report["fit"]["message"]
  assert 100e9 < report["params_bytes_per_device"] < 103e9  # 405B x 2 bytes / 8
  assert "over by 21" in report["fit"]["message"]


def test_deepseek_v3_4x8_dp_attn_ep_matches_committed_report_and_sharding_report():
  saved = json.loads((RESULTS / "gpu_plan_deepseek_v3_4x8_dp_attn_ep.json").read_text())
  w = gpu_plan.Workload(**saved["workload"])
  mesh = saved["mesh_axes"]
  # Only the byte accounting (no compile): a workload too big to fit skips it.
  big = dataclasses.replace(w, batch=64)
  report = gpu_plan.gpu_plan(model="deepseek_v3", mesh_axes=mesh, layout="dp_attn_ep",
                             hosts=4, workload=big)
  assert report["params_bytes_per_device"] == saved["params_bytes_per_device"]
  assert not report["fit"]["fits"] and "params + KV do not fit" in report["fit"]["message"]
  # The same per-device params from the independent AbstractMesh walk.
  ref = sharding_report.sharding_report(model="deepseek_v3", mesh_axes=mesh, layout="dp_attn_ep")
  assert ref["params"]["per_device_bytes"] == saved["params_bytes_per_device"]
  assert saved["fit"]["fits"]
  programs = {p["name"]: p for p in saved["programs"]}
  for p in programs.values():
    assert p["triton_kernels"] and p["kernel_all_gathers"] == 0
    assert p["memory"]["argument_bytes"] >= saved["params_bytes_per_device"]
  # bf16 decode fits; the 512-token prefill chunk's dropless all-to-all
  # buffers (sized for every copy going to one rank) do not, and the report says so.
  assert programs["dp_attn_ep decode"]["fits"]
  assert programs["dp_attn_ep decode"]["peak_bytes"] <= 80e9
  assert not programs["dp_attn_ep mixed"]["fits"]
  assert any("dp_attn_ep mixed: DOES NOT FIT" in v for v in saved["verdicts"])
