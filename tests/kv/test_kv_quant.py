"""Quantized KV cache (`EngineConfig(kv_cache_dtype="fp8" | "int8")`): pool
sizing, the stored values, scales from the params or calibration, the Engine
through the Pallas kernels (interpret mode) against the XLA path, speculative
and sharded engines, agreement with the full-precision cache on the default
model, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import float32_model as _model, random_prompts
from benchlib import kv_quant
from jaxinfer import (Backend, Engine, EngineConfig, MTPConfig, SamplingParams, models, presets,
                      run, sharding)
from jaxinfer.engine import kv_calibration
from jaxinfer.kv import cache as kv_cache, scales as kv_scales
from jaxinfer.kv.pool import KV_CACHE_DTYPES, quantize
from jaxinfer.models import transformer
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.serving.worker import Worker

FP8, INT8 = jnp.float8_e4m3fn, jnp.int8


def _prompts(cfg, lengths, seed=1):
  return random_prompts(cfg, lengths, seed)


def _generate(cfg, params, prompts, max_tokens=6, mesh=None, layout=None, **config):
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=48, max_num_batched_tokens=16,
                                         **config), mesh=mesh, layout=layout)
  return eng, [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=max_tokens))]


@pytest.mark.parametrize("bad", ["fp16", "float8", "bfloat16", "FP8", ""])
def test_bad_kv_cache_dtype_raises_naming_the_field_and_choices(bad):
  with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('fp8', 'int8'\)"):
    EngineConfig(kv_cache_dtype=bad)
  assert EngineConfig().kv_cache_dtype is None  # default: the compute dtype


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])  # GQA k/v; MLA's latent
def test_quantized_pages_hold_2x_bf16_and_4x_f32_tokens_per_byte(name):
  cfg = presets.get(name)
  per = {d: kv_cache.page_bytes(cfg, 16, d) for d in (FP8, INT8, jnp.bfloat16, jnp.float32)}
  assert per[FP8] == per[INT8] and 2 * per[FP8] == per[jnp.bfloat16] and 4 * per[FP8] == per[jnp.float32]
  budget = 100 * per[jnp.float32]
  pages = {d: kv_cache.num_pages_for(cfg, 16, d, kv_cache_bytes=budget) for d in per}
  assert pages[FP8] == 2 * pages[jnp.bfloat16] == 4 * pages[jnp.float32] == 400


def test_engine_given_a_byte_budget_gets_4x_the_pages_of_its_f32_cache():
  cfg, params = _model("tiny_dense")
  budget = 40 * kv_cache.page_bytes(cfg, 8, jnp.float32)
  engines = {kind: Engine(cfg, params, EngineConfig(page_size=8, kv_cache_bytes=budget,
                                                    kv_cache_dtype=kind))
             for kind in (None, "int8", "fp8")}
  pages = {k: e.allocator.num_pages for k, e in engines.items()}
  assert pages == {None: 40, "int8": 160, "fp8": 160}
  paged_bytes = {k: sum(e.pool[0][n].nbytes for n in e.pool.layout.names)
                 for k, e in engines.items()}
  assert paged_bytes["fp8"] == paged_bytes[None] == budget  # the same bytes, 4x the tokens
  assert engines["fp8"].stats()["kv_cache_dtype"] == "float8_e4m3fn"
  assert engines["fp8"].pool[0]["k"].dtype == FP8 and engines["int8"].pool[0]["v"].dtype == INT8


def test_quantize_stores_clip_of_x_over_scale():
  x = jnp.asarray([-1000.0, -3.0, -0.26, 0.0, 0.24, 2.9, 1000.0], jnp.float32)
  np.testing.assert_array_equal(np.asarray(quantize(x, 0.5, INT8)), [-127, -6, -1, 0, 0, 6, 127])
  fp8 = quantize(x, 0.5, FP8)
  assert fp8.dtype == FP8
  np.testing.assert_array_equal(np.asarray(fp8.astype(jnp.float32)),
                                np.asarray(jnp.clip(x / 0.5, -448, 448).astype(FP8)
                                           .astype(jnp.float32)))
  assert float(fp8[0].astype(jnp.float32)) == -448.0  # saturates, never inf / NaN
  # Read back as q * scale: fp8 keeps ~3 mantissa bits, int8 a half step of the scale.
  y = jnp.linspace(-100.0, 100.0, 1001)
  for dtype, s, tol in ((FP8, 100 / 448, 2 ** -4), (INT8, 100 / 127, None)):
    back = quantize(y, s, dtype).astype(jnp.float32) * s
    err = np.abs(np.asarray(back - y))
    bound = tol * np.abs(np.asarray(y)) + 2 ** -9 * s if tol else np.full(y.shape, s / 2 + 1e-6)
    assert np.all(err <= bound)
  assert quantize(x, None, jnp.float32) is not None  # unquantized: a cast


def test_init_pool_needs_scales_for_every_segment():
  cfg = presets.get("tiny_moe")
  with pytest.raises(ValueError, match="scales"):
    kv_cache.init_pool(cfg, 4, 4, FP8)
  L = [n for _, _, n in cfg.segments()]
  with pytest.raises(ValueError, match="kv_scale"):
    kv_cache.init_pool(cfg, 4, 4, FP8, scales=[{"k_scale": jnp.ones(n)} for n in L])
  with pytest.raises(ValueError, match=r"must be float32 \["):
    kv_cache.init_pool(cfg, 4, 4, FP8, scales=[{"kv_scale": jnp.ones(n + 1)} for n in L])
  pool = kv_cache.init_pool(cfg, 4, 4, FP8, scales=[{"kv_scale": jnp.full(n, 0.5)} for n in L])
  assert pool.layout.quantized and pool.layout.scale_names == ("kv_scale",)
  blob = kv_cache.gather_pages(pool, jnp.asarray([1, 2]))
  assert set(blob[0]) == {"kv"}  # pages move, the scales stay
  out = kv_cache.scatter_pages(pool, jnp.asarray([3, 1]), blob)
  np.testing.assert_array_equal(out[0]["kv_scale"], np.full(L[0], 0.5, np.float32))
  plain = kv_cache.gather_pages(kv_cache.init_pool(cfg, 4, 4, jnp.float32), jnp.asarray([1]))
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    kv_cache.scatter_pages(out, jnp.asarray([2]), plain)


def test_calibrated_scales_are_per_layer_amax_over_qmax():
  cfg, params = _model("tiny_dense")
  tokens = kv_calibration.calibration_prompt(cfg)
  cache = transformer.init_cache(cfg, 1, tokens.shape[1])
  _, cache = transformer.forward(cfg, params, tokens, cache)
  for kind, (_, top) in KV_CACHE_DTYPES.items():
    scales = kv_calibration.calibrate(cfg, params, kind)
    assert len(scales) == len(cfg.segments())
    for seg, got in zip(cache["layers"], scales):
      for n in ("k", "v"):
        amax = np.max(np.abs(np.asarray(seg[n])), axis=(1, 2, 3, 4))
        want = amax / top if kind == "int8" else 2.0 ** np.ceil(np.log2(amax / top))
        np.testing.assert_allclose(got[f"{n}_scale"], want, rtol=1e-6)
  with pytest.raises(ValueError, match="kind"):
    kv_calibration.calibrate(cfg, params, "fp4")


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_scales_from_params_are_used_and_kept_out_of_the_forward(name):
  cfg, params = _model(name)
  names = kv_scales.scale_names(cfg)
  given = [{n: jnp.full(seg["attn"]["wq" if "wq" in seg["attn"] else "wkv_a"].shape[0],
                        0.01 * (i + 1), jnp.float32) for n in names}
           for i, seg in enumerate(params["layers"])]
  with_scales = {**params, "layers": tuple({**seg, "attn": {**seg["attn"], **g}}
                                           for seg, g in zip(params["layers"], given))}
  spec = MTPConfig(num_draft_tokens=2) if cfg.num_mtp_layers else None
  if spec is not None:  # the MTP modules' scales [M] in params["mtp"]["block"]["attn"]
    block = params["mtp"]["block"]
    given.append({n: jnp.full(cfg.num_mtp_layers, 0.07, jnp.float32) for n in names})
    with_scales["mtp"] = {**params["mtp"], "block": {**block, "attn": {**block["attn"],
                                                                       **given[-1]}}}
  prompts = _prompts(cfg, [3, 20])
  eng, out = _generate(cfg, with_scales, prompts, kv_cache_dtype="fp8", speculative=spec)
  assert eng.kv_scales_source == "params"
  for got, want in zip(eng.kv_scales, given):
    assert set(got) == set(names)
    for n in names:
      np.testing.assert_array_equal(got[n], np.asarray(want[n]))  # the caller's still alive
  assert not set(names) & set(eng.params["layers"][0]["attn"])
  assert all(len(o) == 6 for o in out)
  if name == "tiny_dense":  # partial scales: the rest is calibrated
    partial = {**params, "layers": tuple({**seg, "attn": {**seg["attn"], "k_scale": g["k_scale"]}}
                                         for seg, g in zip(params["layers"], given))}
    eng2, _ = _generate(cfg, partial, prompts[:1], max_tokens=1, kv_cache_dtype="int8")
    assert eng2.kv_scales_source == "calibrated"


# Each kind once, on GQA and on MLA (CI time: the per-tile dequantization is
# the kind's, the same for both attention forms).
@pytest.mark.parametrize("name,kind", [("tiny_moe", "fp8"), ("tiny_dense", "int8")])
def test_engine_quantized_kv_pallas_interpret_equals_xla(name, kind):
  # The kernel reads the quantized pages and dequantizes per tile; the XLA
  # path dequantizes after its gather: the same greedy tokens.
  cfg, params = _model(name)
  prompts = _prompts(cfg, [1, 13, 30])
  outs = {impl: _generate(dataclasses.replace(cfg, backend=Backend(attention=impl)), params,
                          prompts, kv_cache_dtype=kind)[1] for impl in ("xla", "pallas")}
  assert outs["pallas"] == outs["xla"]
  # (Agreement with the full-precision cache is measured on the trained
  # default model below: random weights give near-tied logits.)


def test_speculative_with_fp8_kv_equals_plain_fp8_greedy():
  cfg, params = _model("tiny_moe")
  prompts = _prompts(cfg, [5, 17, 33])
  _, plain = _generate(cfg, params, prompts, max_tokens=8, kv_cache_dtype="fp8")
  eng, spec = _generate(cfg, params, prompts, max_tokens=8, kv_cache_dtype="fp8",
                        speculative=MTPConfig(num_draft_tokens=2))
  assert spec == plain
  assert len(eng.kv_scales) == len(cfg.segments()) + 1  # the MTP entry's own scales


@pytest.mark.parametrize("axes,layout", [({"tensor": 2}, "tp"),
                                         ({"data": 2, "expert": 2}, "dp_attn_ep")])
def test_sharded_engine_with_fp8_kv_equals_single_device(axes, layout):
  cfg, params = _model("tiny_moe")
  prompts = _prompts(cfg, [4, 19, 9, 27])
  _, single = _generate(cfg, params, prompts, kv_cache_dtype="fp8")
  eng, out = _generate(cfg, params, prompts, kv_cache_dtype="fp8",
                       mesh=sharding.make_mesh(axes, jax.devices()[:np.prod(list(axes.values()))]),
                       layout=layout)
  assert out == single
  scale = eng.pool[1]["kv_scale"]
  assert scale.sharding.is_fully_replicated


def test_disaggregated_fp8_prefill_and_decode_equal_one_fp8_engine():
  # Prefill tensor-parallel on devices 0-3, decode attention-DP on 4-7, both
  # fp8: the stored pages move as they are, each side calibrated its own
  # (power-of-two, so equal) scales.
  cfg = dataclasses.replace(presets.get("tiny_moe", num_experts=8, n_group=2, topk_group=1,
                                        num_heads=8, num_kv_heads=8, num_layers=2,
                                        num_mtp_layers=0), dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  config = EngineConfig(page_size=4, num_pages=48, max_num_seqs=4, max_num_batched_tokens=32,
                        kv_cache_dtype="fp8")
  prompts = _prompts(cfg, [3, 17, 9, 30])
  sampling = SamplingParams(max_tokens=6)
  ref = Engine(cfg, params, config)
  devices = jax.devices()
  prefill = Worker(cfg, params, config, role="prefill", devices=devices[:4],
                   mesh_axes={"tensor": 4}, layout="tp", name="prefill")
  decode = Worker(cfg, params, config, role="decode", devices=devices[4:8],
                  mesh_axes={"data": 2, "expert": 2}, layout="dp_attn_ep", name="decode")
  for w in (prefill, decode):
    for a, b in zip(w.engine.kv_scales, ref.kv_scales):
      np.testing.assert_array_equal(a["kv_scale"], b["kv_scale"])
  outs = Cluster([prefill, decode], disagg=DisaggConfig(mode="always")).generate(prompts, sampling)
  assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, sampling)]
  assert all(o.prefill_worker == 0 and o.worker == 1 for o in outs)


def test_default_model_greedy_agreement_with_full_precision_kv():
  # Reported in full by experiments/kv_quant.py (experiments/results/kv_quant.json).
  cfg, params, tokenizer = run.load_default_model()
  prompts = kv_quant.stdlib_prompts(tokenizer.encode, 8)
  out = kv_quant.kv_quant_agreement(cfg, params, prompts, max_tokens=16)
  rows = {r["kv_cache_dtype"]: r for r in out["rows"]}
  assert rows["full"]["token_match"] == 1.0
  for kind in ("fp8", "int8"):
    assert rows[kind]["scales"] == "calibrated"
    assert rows[kind]["bytes_per_token"] * 4 == rows["full"]["bytes_per_token"]  # f32 model
    assert rows[kind]["token_match"] >= 0.5 and rows[kind]["prefix_match"] >= 0.5, rows[kind]
