"""`Backend.dense_attention`: attention from `jax.nn.dot_product_attention`.

Its XLA form ("jax_nn") runs here, so the argument mapping (GQA, scale,
causality, HF's window, per-row lengths, the fresh chunks' padding) is
checked against the float32 references on a CPU; the same calls with
"cudnn" run only on a GPU (cuDNN cannot even be lowered without the cuDNN
library and a device). The Engine takes the library for steps of fresh
prompt chunks only: a broken library path changes its tokens.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchlib import gpu_plan, wan_plan
from vl_inputs import VL
import jaxinfer
from jaxinfer import (Backend, checkpoint, gpu_compile, library_attention, models, ops, presets,
                      xla_attention)
from jaxinfer.config import ModelConfig
from jaxinfer.diffusion.wan_config import a14b_expert
from jaxinfer.engine import scheduler, steps
from jaxinfer.models import multimodal, vision
import pallas_kernels

LIB = Backend(dense_attention="jax_nn")


def _qkv(key, B, T, N, K, H, S=None):
  kq, kk, kv = jax.random.split(key, 3)
  S = S or T
  return (jax.random.normal(kq, (B, T, N, H)), jax.random.normal(kk, (B, S, K, H)),
          jax.random.normal(kv, (B, S, K, H)))


@pytest.mark.parametrize("window", [0, 5])
def test_causal_attention_through_the_library_equals_the_reference(window):
  q, k, v = _qkv(jax.random.key(0), 2, 24, 8, 2, 32)
  got = ops.causal_attention(q, k, v, window=window, scale=0.3, backend=LIB)
  want = pallas_kernels.flash_attention_reference(q, k, v, causal=True, sm_scale=0.3,
                                                  window=window)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_full_attention_through_the_library_equals_the_reference():
  q, k, v = _qkv(jax.random.key(1), 2, 12, 4, 4, 16, S=20)
  got = ops.full_attention(q, k, v, scale=0.25, backend=LIB)
  want = pallas_kernels.flash_attention_reference(q, k, v, causal=False, sm_scale=0.25)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_fresh_chunks_padded_for_the_library_equal_the_packed_xla_form(window):
  """Three chunks of 5, 7 and 1 tokens, padding rows after them, and an
  empty padding sequence: the library over [B, max_q] and back equals our
  packed XLA form, padding rows zero."""
  T, N, K, H = 16, 4, 2, 8
  key = jax.random.key(2)
  q, k, v = (jax.random.normal(kk, (T, n, H)) for kk, n in zip(jax.random.split(key, 3),
                                                                  (N, K, K)))
  cu = jnp.asarray([0, 5, 12, 13, 13], jnp.int32)
  got = library_attention.fresh_packed(q, k, v, cu, 8, scale=0.4, impl="jax_nn", window=window)
  want = xla_attention.packed_step(q, k, v, cu, window, None, 0.4)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(got[13:]))


def test_the_host_marks_steps_of_fresh_chunks_only():
  """`steps.fresh_shapes`: a step is the library's only when its model asks
  and every chunk starts a prompt at position 0."""
  lib_cfg = dataclasses.replace(presets.get("tiny_dense"), backend=LIB)
  shapes = steps.StepShapes(tokens=32, seqs=4, pages=4, max_q=16)
  chunk = lambda n, start, **kw: scheduler.Scheduled(None, n, start, True, **kw)
  fresh = lambda cfg, *busy, **kw: steps.fresh_shapes(cfg, shapes, busy, **kw).fresh
  assert fresh(lib_cfg, [chunk(7, 0), chunk(3, 0)], [chunk(5, 0)])  # two ranks
  assert not fresh(lib_cfg, [chunk(7, 0), chunk(3, 4)])  # a later chunk: its prefix cached
  assert not fresh(lib_cfg, [chunk(7, 0), chunk(1, 9)])  # beside a decode
  assert not fresh(lib_cfg, [chunk(4, 0, num_draft=3)])  # drafts
  assert not fresh(lib_cfg, [chunk(7, 0)], n=2) and not fresh(lib_cfg, [chunk(7, 0)], K=3)
  assert not fresh(presets.get("tiny_dense"), [chunk(7, 0)])  # the model does not ask


def test_what_the_library_does_not_take_is_named():
  unfit = library_attention.unfit
  assert unfit("jax_nn", (1, 8, 4, 64), 64, jnp.float32) is None
  assert "sinks" in unfit("jax_nn", (1, 8, 4, 64), 64, jnp.float32, sinks=jnp.zeros(4))
  assert "traced window" in unfit("jax_nn", (1, 8, 4, 64), 64, jnp.float32,
                                  window=jnp.int32(4))
  assert unfit("cudnn", (1, 8, 4, 128), 128, jnp.bfloat16, on_gpu=False) == (
      "cuDNN runs on GPUs only")
  assert "float32" in unfit("cudnn", (1, 8, 4, 128), 128, jnp.float32)
  assert "192 and 128" in unfit("cudnn", (1, 8, 4, 192), 128, jnp.bfloat16)  # MLA prefill
  assert unfit("cudnn", (1, 8, 4, 128), 128, jnp.bfloat16) is None
  with pytest.raises(ValueError, match="dense_attention"):
    Backend(dense_attention="flash3")
  # A case the library does not take runs our kernels: GPT-OSS's sinks.
  q, k, v = _qkv(jax.random.key(3), 1, 8, 4, 2, 16)
  sinks = jnp.linspace(-1.0, 1.0, 4)
  np.testing.assert_array_equal(
      ops.causal_attention(q, k, v, sinks=sinks, scale=0.25, backend=LIB),
      ops.causal_attention(q, k, v, sinks=sinks, scale=0.25))


def test_the_library_form_compiles_for_an_h100():
  """The XLA form builds for a compile-only H100 here (cuDNN's cannot: its
  lowering asks the cuDNN library for its version, and its compile builds
  cuDNN graphs on a device)."""
  mesh = gpu_compile.mesh({"data": 1}, gpu="h100")
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                            sharding=jax.sharding.NamedSharding(
                                                mesh, jax.sharding.PartitionSpec()))
  backend = Backend(dense_attention="jax_nn", target="gpu")
  f = jax.jit(lambda q, k, v: ops.causal_attention(q, k, v, scale=0.1, backend=backend))
  with gpu_compile.lowering(mesh):
    compiled = f.lower(spec((1, 256, 8, 128)), spec((1, 256, 2, 128)),
                       spec((1, 256, 2, 128))).compile()
  assert "custom-call" not in compiled.as_text() or "triton" not in compiled.as_text()


def test_an_engine_step_of_fresh_chunks_compiles_for_an_h100_without_our_kernel():
  """The Engine's prompt step marked fresh (`steps.fresh_shapes`), with the
  library's XLA form, compiles for a compile-only H100 and holds none of
  our attention kernels; unmarked, the same step runs them."""
  cfg = dataclasses.replace(gpu_plan.gpu_config(presets.get("tiny_dense"), "bfloat16"),
                            backend=Backend(dense_attention="jax_nn", target="gpu"))
  w = gpu_plan.Workload(batch=2, context=32, prefill_tokens=32)
  mesh = gpu_compile.mesh({"data": 1}, gpu="h100")
  params = gpu_plan.abstract_params(cfg, mesh, "tp")
  pool = gpu_plan.abstract_pool(cfg, mesh, "tp", w.pool_pages(), w.page_size)
  kernels = {}
  for fresh in (True, False):
    lowered, shapes = gpu_plan.lower_step(cfg, params, pool, mesh, "tp", [(32, 32), (16, 16)], w,
                                          fresh=fresh)
    report = gpu_plan.compile_program(lowered, 80e9, pool)
    kernels[fresh] = report["triton_kernels"] or report["mosaic_kernels"] > 0
  assert shapes.max_q == 32 and kernels == {True: False, False: True}
  with pytest.raises(ValueError, match="fresh chunks"):
    gpu_plan.lower_step(cfg, params, pool, mesh, "tp", [(1, 32)], w, fresh=True)


def test_wan_dit_and_the_vision_encoder_through_the_library_compile_for_an_h100():
  """A WAN denoising step (one small DiT layer, heads of 64) and the Qwen3-VL
  vision tower compile for compile-only H100s with the library's XLA form:
  the DiT then holds none of our flash kernel (which it holds without it:
  tests/gpu/test_gpu_compile_wan.py)."""
  dit = a14b_expert(num_layers=1, num_heads=2, head_dim=64, ffn_dim=256, text_dim=64,
                    freq_dim=32, backend=Backend(dense_attention="jax_nn"))
  plan = wan_plan.wan_step_plan(seq=1, cfg_parallel=1, frames=5, height=64, width=64,
                                text_len=8, cfg=dit)
  # Two latent frames of 8 x 8 in 2 x 2 patches.
  assert plan["fits"] and not plan["triton"] and plan["tokens"] == 2 * 4 * 4
  hf = json.loads((VL / "qwen3_vl" / "config.json").read_text())
  cfg = gpu_plan.gpu_config(ModelConfig.from_hf(hf), "bfloat16")
  mesh = gpu_compile.mesh({"data": 1}, gpu="h100")
  params = gpu_plan.abstract_params(cfg, mesh, "tp")
  vc, rep = cfg.vision, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  with gpu_compile.lowering(mesh):
    encoder = vision.encode.lower(
        vc, params["vision"], jax.ShapeDtypeStruct((24, vc.patch_dim), jnp.float32, sharding=rep),
        ((1, 4, 6),), Backend(dense_attention="jax_nn", target="gpu")).compile()
  assert [o.shape for o in jax.tree.leaves(encoder.out_info)][0] == (6, cfg.d_model)


def _greedy(cfg, params, prompts):
  eng = jaxinfer.Engine(cfg, params, jaxinfer.EngineConfig(
      max_num_seqs=4, num_pages=64, page_size=8, max_num_batched_tokens=64,
      unroll_layers=True))
  outs = eng.generate(prompts, jaxinfer.SamplingParams(max_tokens=6, temperature=0.0))
  return [o.token_ids for o in outs]


def test_the_engine_takes_the_library_for_fresh_prompt_steps(monkeypatch):
  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  # The last prompt takes two steps (budget 64): its second chunk, over its
  # cached first one, is not the library's.
  prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 33)), list(range(40, 110))]
  lib_cfg = dataclasses.replace(cfg, backend=LIB)
  want = _greedy(cfg, params, prompts)
  assert _greedy(lib_cfg, params, prompts) == want
  # The library's branch really runs in those steps: broken, the tokens change.
  monkeypatch.setattr(library_attention, "fresh_packed",
                      lambda q, k, v, *a, **kw: jnp.zeros(q.shape[:2] + v.shape[-1:], q.dtype))
  jax.clear_caches()
  assert _greedy(lib_cfg, params, prompts) != want


def test_the_vision_encoder_through_the_library_equals_its_xla_form(monkeypatch):
  cfg, params = checkpoint.load_hf(str(VL / "qwen3_vl"), dtype=jnp.float32)
  vc = cfg.vision
  grids = ((1, 4, 4), (2, 2, 4))  # an image and a two-frame video: three frames
  n = sum(t * h * w for t, h, w in grids)
  pixels = jax.random.normal(jax.random.key(4), (n, vc.patch_dim))
  want = multimodal.encode_images(cfg, params, pixels, grids)
  got = multimodal.encode_images(dataclasses.replace(cfg, backend=LIB), params, pixels, grids)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
  # ... and the library runs there: broken, the visual tokens change.
  monkeypatch.setattr(library_attention, "dense", lambda q, k, v, **kw: jnp.zeros_like(q))
  jax.clear_caches()
  broken = multimodal.encode_images(dataclasses.replace(cfg, backend=LIB), params, pixels, grids)
  assert not np.allclose(broken[0], want[0], atol=1e-3)
