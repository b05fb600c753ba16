"""The Mosaic GPU paged decode kernel against the float32 reference, in
Mosaic GPU's interpret mode on CPU (jax >= 0.11; `TestMosaicPagedGpu`, only
where a GPU is present, runs the same cases compiled), its compile for H100
at serving shapes, and its named errors. On jax 0.10, which has no Mosaic
GPU interpreter, the kernel refuses by name."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchlib import gpu_cases
import pallas_kernels as pk
from conftest import (ON_GPU, assert_greedy_is_f32_argmax, kernel_rel_err as _rel,
                      mosaic_kernels_for_h100, subprocess_env)
from jaxinfer import (Backend, Engine, EngineConfig, MTPConfig, SamplingParams, gpu_compile,
                      models, ops, presets)
from pallas_kernels import mosaic_mla_attention as mma
from pallas_kernels import mosaic_paged_attention as mpa

ROOT = pathlib.Path(__file__).parents[2]
CASES = [  # B, Q, N, K, D, ps, pps, lengths, extra
    (2, 1, 8, 2, 64, 16, 8, None, {}),                               # GQA 4, 4 pages a block
    (2, 2, 8, 2, 128, 16, 9, [3, 130], {}),                          # Q 2, a 3-token sequence
    (1, 4, 4, 1, 64, 64, 3, None, dict(window=70, sinks=True)),      # Q 4, window skips blocks
    (2, 1, 4, 2, 64, 8, 20, None, dict(num_splits=3, sinks=True)),   # split-K, 8 pages a block
    (1, 1, 2, 1, 64, 32, 6, [1], dict(num_splits=2)),                # one token, an empty split
    (3, 1, 16, 1, 64, 16, 6, None, dict(slots=3)),                   # GQA 16, 3 blocks in flight
]


def _inputs(rng, B, Q, N, K, D, ps, pps, lengths):
  P = B * pps + 2
  q = jnp.asarray(rng.normal(size=(B, Q, N, D)), jnp.bfloat16)
  kp = jnp.asarray(rng.normal(size=(K, P, ps, D)), jnp.bfloat16)
  vp = jnp.asarray(rng.normal(size=(K, P, ps, D)), jnp.bfloat16)
  lens = rng.integers(Q, pps * ps + 1, B) if lengths is None else lengths
  tables = rng.permutation(P)[:B * pps].reshape(B, pps)
  return q, kp, vp, jnp.asarray(lens, jnp.int32), jnp.asarray(tables, jnp.int32)


if mpa.available() is None:

  class TestMosaicPaged:
    interpret = True

    @pytest.mark.parametrize("case", range(len(CASES)))
    def test_matches_reference(self, case):
      B, Q, N, K, D, ps, pps, lengths, extra = CASES[case]
      extra = dict(extra)
      rng = np.random.default_rng(case)
      q, kp, vp, lens, tables = _inputs(rng, B, Q, N, K, D, ps, pps, lengths)
      sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32) if extra.pop("sinks", 0) else None
      out = mpa.mosaic_paged_attention(q, kp, vp, lens, tables, sinks=sinks,
                                       interpret=self.interpret, **extra)
      f32 = lambda x: x.astype(jnp.float32)
      ref = pk.paged_attention_reference(f32(q), f32(kp), f32(vp), lens, tables, sinks=sinks,
                                         window=extra.get("window", 0))
      assert out.shape == q.shape and out.dtype == q.dtype
      assert _rel(out, ref) <= 2e-2

    def test_decode_form_equals_the_triton_kernel(self):
      rng = np.random.default_rng(7)
      q, kp, vp, lens, tables = _inputs(rng, 3, 1, 8, 2, 64, 16, 5, None)
      ours = mpa.mosaic_paged_attention(q[:, 0], kp, vp, lens, tables, interpret=self.interpret)
      triton = pk.paged_attention(q[:, 0], kp, vp, lens, tables, interpret=self.interpret)
      assert ours.shape == (3, 8, 64) and _rel(ours, triton) <= 2e-2

    @pytest.mark.parametrize("change,exc,match", [
        (dict(dtype=jnp.float32), TypeError, "bfloat16 or float16"),
        (dict(D=72), ValueError, "multiple of 64"),
        (dict(N=80, K=1), ValueError, "80 > 64 rows"),
        (dict(ps=12), ValueError, "page_size"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(slots=1), ValueError, "slots"),
        (dict(slots=9, D=256, ps=64), ValueError, "shared memory"),
    ])
    def test_bad_inputs_are_named(self, change, exc, match):
      dims = dict(B=1, Q=1, N=4, K=2, D=64, ps=16, dtype=jnp.bfloat16)
      kw = {k: change.pop(k) for k in ("num_splits", "slots") if k in change}
      dims.update(change)
      q = jnp.zeros((dims["B"], dims["Q"], dims["N"], dims["D"]), dims["dtype"])
      pages = jnp.zeros((dims["K"], 4, dims["ps"], dims["D"]), dims["dtype"])
      with pytest.raises(exc, match=match):
        mpa.mosaic_paged_attention(q, pages, pages, jnp.ones((1,), jnp.int32),
                                   jnp.zeros((1, 4), jnp.int32), interpret=True, **kw)

    @pytest.mark.parametrize("B,Q,N,R,Hr,ps,pps,splits,cluster,slots,kw", [
        (2, 1, 16, 128, 64, 64, 3, 1, False, 2, {}),   # TP-sharded heads, a page = two steps
        # 128 rows = two row blocks, pages pair up, split-K; 3 slots in flight
        (1, 2, 64, 128, 64, 16, 5, 2, False, 3, {}),
        (3, 1, 8, 512, 64, 32, 2, 1, False, 2, {}),    # DeepSeek's latent and rope widths
        # The row blocks as one cluster sharing each latent read: 2 blocks with pages
        # paired and split-K (an empty split when short), 4 (two sequences; 4 slots), 8.
        (2, 2, 64, 128, 64, 16, 5, 2, True, 2, {}),
        (2, 4, 64, 128, 64, 16, 4, 1, True, 4, {}),
        (1, 4, 128, 128, 64, 64, 2, 2, True, 2, {}),
        # 64 keys a step (128-byte swizzles): DeepSeek's widths with pages of 32
        # paired; 4 pages of 16 a step, clustered and split-K (the last block partial).
        (3, 1, 8, 512, 64, 32, 3, 1, False, 2, dict(block_keys=64)),
        (2, 2, 64, 128, 64, 16, 5, 2, True, 2, dict(block_keys=64)),
        # Each warpgroup computes half of S's dot (halves 288 + 288 at 32 keys a step;
        # 128 + 64 of 192 at 64), the two added through shared memory: over 3 slots,
        # clustered and split-K.
        (3, 1, 8, 512, 64, 32, 3, 1, False, 3, dict(split_scores=True)),
        (2, 2, 64, 128, 64, 16, 5, 2, True, 2, dict(split_scores=True, block_keys=64)),
    ])
    def test_mla_matches_reference(self, B, Q, N, R, Hr, ps, pps, splits, cluster, slots, kw):
      rng = np.random.default_rng(B * N + ps)
      P = B * pps + 1
      q = jnp.asarray(rng.normal(size=(B, Q, N, R + Hr)), jnp.bfloat16)
      pages = jnp.asarray(rng.normal(size=(P, ps, R + Hr)), jnp.bfloat16)
      lens = jnp.asarray(rng.integers(Q, pps * ps + 1, B), jnp.int32)
      tables = jnp.asarray(rng.permutation(P)[:B * pps].reshape(B, pps), jnp.int32)
      scale = (R + Hr) ** -0.5
      out = mma.mosaic_mla_attention(q[..., :R], q[..., R:], pages, lens, tables, sm_scale=scale,
                                     num_splits=splits, cluster=cluster, slots=slots,
                                     interpret=self.interpret, **kw)
      f32 = lambda x: x.astype(jnp.float32)
      ref = pk.mla_paged_attention_reference(f32(q[..., :R]), f32(q[..., R:]), f32(pages), lens,
                                             tables, sm_scale=scale)
      assert out.shape == (B, Q, N, R) and _rel(out, ref) <= 2e-2

    @pytest.mark.parametrize("R,Hr,ps,dtype,kw,match", [
        (96, 64, 16, jnp.bfloat16, {}, "multiple of 64"),
        (128, 64, 24, jnp.bfloat16, {}, "page_size"),
        (128, 64, 16, jnp.float32, {}, "bfloat16"),
        (128, 64, 16, jnp.bfloat16, dict(block_keys=48), "block_keys must be one of"),
        (64, 64, 16, jnp.bfloat16, dict(block_keys=64), "multiple of 128"),
        (512, 64, 64, jnp.bfloat16, dict(block_keys=64, slots=3), "shared memory"),
        (512, 64, 64, jnp.bfloat16, dict(block_keys=64, split_scores=True), "shared memory"),
        (128, 64, 16, jnp.bfloat16, dict(split_scores=1), "split_scores must be a bool")])
    def test_mla_bad_inputs_are_named(self, R, Hr, ps, dtype, kw, match):
      q = jnp.zeros((1, 4, R + Hr), dtype)
      with pytest.raises((ValueError, TypeError), match=match):
        mma.mosaic_mla_attention(q[..., :R], q[..., R:], jnp.zeros((2, ps, R + Hr), dtype),
                                 jnp.ones((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                                 sm_scale=0.1, interpret=True, **kw)

    def test_mla_cluster_must_be_a_bool(self):
      q = jnp.zeros((1, 128, 192), jnp.bfloat16)
      with pytest.raises(TypeError, match="cluster must be a bool"):
        mma.mosaic_mla_attention(q[..., :128], q[..., 128:], jnp.zeros((2, 16, 192), jnp.bfloat16),
                                 jnp.ones((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                                 sm_scale=0.1, cluster="yes", interpret=True)

  if ON_GPU:

    class TestMosaicPagedGpu(TestMosaicPaged):
      interpret = False

  ENGINE_MODELS = {  # the Mosaic kernel's sizes: head dim 64; MLA latent 64 + rope 32
      "gqa": ("_ragged_mosaic", dict(name="tiny_dense", head_dim=64), {}),
      "mla": ("_ragged_mosaic_mla", dict(name="tiny_moe", qk_rope_head_dim=32), {}),
      # 128 heads: two row blocks, one cluster (Backend.trials)
      "mla_cluster": ("_ragged_mosaic_mla", dict(name="tiny_moe", qk_rope_head_dim=32,
                                                 num_heads=128, num_kv_heads=128),
                      dict(trials=("mla_cluster",))),
      # GQA 8: items of 8 tokens, wide ones of 16; the 21-token prompt fills two
      "gqa_wide": ("_ragged_mosaic", dict(name="tiny_dense", head_dim=64, num_heads=8,
                                          num_kv_heads=1), dict(trials=("wide_items",))),
      # GQA 16: the 21-token prompt's two items of 4 tiles (16 tokens) as one cluster
      "gqa_cluster": ("_ragged_mosaic", dict(name="tiny_dense", head_dim=64, num_heads=16,
                                             num_kv_heads=1), dict(trials=("cluster_items",))),
  }

  @pytest.mark.parametrize("model", ENGINE_MODELS)
  def test_engine_decodes_on_the_mosaic_kernel(monkeypatch, model):
    """Backend(attention="mosaic") (CPU: interpreted): decode steps go through the
    Mosaic kernel (GQA or MLA, counted at trace time; GQA prompt steps too,
    on the ragged kernel, MLA's on the Pallas path), and every greedy token
    is the argmax of a float32 full forward up to bfloat16 rounding of the
    logits."""
    calls = []
    route, preset, extra = ENGINE_MODELS[model]
    real = getattr(ops, route)
    monkeypatch.setattr(ops, route, lambda *a: calls.append(a) or real(*a))
    cfg = presets.get(dtype="bfloat16", num_layers=2,
                      backend=Backend(attention="mosaic", **extra), **preset)
    params = models.init_params(cfg, jax.random.key(0))
    prompts = [[5, 17, 99], list(range(40, 61))]
    eng = Engine(cfg, params, EngineConfig(page_size=16, num_pages=16, max_num_seqs=2,
                                           max_num_batched_tokens=32))
    outs = eng.generate(prompts, SamplingParams(max_tokens=4))
    assert calls, "no decode step reached the Mosaic kernel"
    # The last argument: cluster (MLA, a bool) / the variant (GQA), the trials' own.
    seen = {"mla_cluster" if a[-1] is True else a[-1] for a in calls} - {False, "gqa"}
    assert seen == ({model} if "_" in model else set())
    assert_greedy_is_f32_argmax(cfg, params, prompts, outs)

  # (CI time: the clustered form only; test_engine_decodes_on_the_mosaic_kernel[mla]
  # decodes on the plain one.)
  @pytest.mark.parametrize("heads,trials", [(64, ("mla_cluster",))])
  def test_mtp_verify_steps_run_on_the_mosaic_mla_kernel(monkeypatch, heads, trials):
    """MTP speculation under MLA with Backend(attention="mosaic") (CPU:
    interpreted): verify steps (up to 3 tokens a sequence, in max_q's bucket
    of 4) reach the Mosaic MLA kernel, with 64 heads as one cluster of 4
    row blocks (8, at 128 heads, starves the interpreter's threads inside
    the Engine's step); every emitted token is the argmax of a float32 full
    forward up to bfloat16 rounding."""
    calls = []
    real = ops._ragged_mosaic_mla
    monkeypatch.setattr(ops, "_ragged_mosaic_mla", lambda *a: calls.append(a) or real(*a))
    cfg = presets.get("tiny_moe", dtype="bfloat16", num_layers=2, qk_rope_head_dim=32,
                      num_heads=heads, num_kv_heads=heads,
                      backend=Backend(attention="mosaic", trials=trials))
    params = models.init_params(cfg, jax.random.key(1))
    prompts = [[5, 17, 99], list(range(40, 61))]
    eng = Engine(cfg, params, EngineConfig(page_size=16, num_pages=16, max_num_seqs=2,
                                           max_num_batched_tokens=32,
                                           speculative=MTPConfig(num_draft_tokens=2)))
    outs = eng.generate(prompts, SamplingParams(max_tokens=5))
    verify = [a for a in calls if 1 < a[-2] <= 4]  # (..., max_q, cluster); K + 1 -> 4
    assert verify and all(a[-1] == bool(trials) for a in verify), [a[-2:] for a in calls]
    assert_greedy_is_f32_argmax(cfg, params, prompts, outs)

  def test_tune_dry_run_writes_checked_variants(tmp_path):
    out = tmp_path / "tune.json"
    proc = subprocess.run([sys.executable, "experiments/mosaic_tune.py", "--dry_run",
                           f"--out={out}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    variants = json.loads(out.read_text())["cases"][0]["variants"]
    assert len(variants) >= 3
    assert all(v["status"] == "ok" and v["rel_err"] < 2e-2 for v in variants.values())

  @pytest.mark.parametrize("B,Q,N,K,D,ps,pps,kw", [
      (32, 1, 32, 8, 128, 16, 64, {}),                          # Llama-3 8B decode, 1k context
      (8, 4, 64, 8, 64, 64, 128, dict(num_splits=4, slots=3)),  # GPT-OSS verify, 8k, split-K
  ])
  def test_compiles_for_h100_at_serving_shapes(B, Q, N, K, D, ps, pps, kw):
    """ptxas: no spills (P V accumulates in place; 196-202 registers measured
    at the gate's Llama-8B cases, 226-231 before)."""
    P = B * pps

    def build(sharding):
      s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
      return (lambda *a: mpa.mosaic_paged_attention(*a, **kw),
              (s((B, Q, N, D), jnp.bfloat16), s((K, P, ps, D), jnp.bfloat16),
               s((K, P, ps, D), jnp.bfloat16), s((B,), jnp.int32), s((B, pps), jnp.int32)))
    kernels = mosaic_kernels_for_h100(build)
    assert kernels and all(0 < k["registers"] <= 255 and k["spill_store_bytes"] == 0
                           for k in kernels), kernels
    assert mpa.smem_bytes(D, ps, kw.get("slots", 2)) <= mpa.SMEM_BYTES

  @pytest.mark.parametrize("B,N,ps,pps,splits,kw", [
      (8, 128, 64, 128, 4, {}),   # DeepSeek-V3 without TP: 128 heads, 8k context
      (64, 16, 64, 16, 1, {}),    # 16 heads a device under TP 8, 1k context
      # 64 keys a step (4 pages of 16), clustered; S's dot split, over 3 slots
      (8, 128, 16, 512, 4, dict(block_keys=64, cluster=True)),
      (8, 128, 64, 128, 4, dict(split_scores=True, cluster=True, slots=3)),
  ])
  def test_mla_compiles_for_h100_at_serving_shapes(B, N, ps, pps, splits, kw):
    """ptxas: no spills (P V accumulates in place; measured: 234 registers
    at 32 keys a step, 254-255 at 64, 232 with S's dot split over 3 slots)."""
    def build(sharding):
      s = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
      i = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
      fn = lambda *a: mma.mosaic_mla_attention(*a, sm_scale=0.1, num_splits=splits, **kw)
      return fn, (s((B, N, 512)), s((B, N, 64)), s((B * pps, ps, 576)), i((B,)), i((B, pps)))
    kernels = mosaic_kernels_for_h100(build)
    assert kernels and all(0 < k["registers"] <= 255 and k["spill_store_bytes"] == 0
                           for k in kernels), kernels
    assert mma.smem_bytes(576, 512, kw.get("slots", 2), 2, kw.get("block_keys", mma.KEYS),
                          kw.get("split_scores", False)) <= mpa.SMEM_BYTES

  GATE = [c for c in gpu_cases.CASES
          if c.kernel in ("paged", "mla") and "h100" in c.gpus and not c.kv_dtype]

  @pytest.mark.parametrize("case", GATE, ids=lambda c: c.name)
  def test_gate_cases_compile_on_mosaic_with_planned_bytes(case):
    """Every unquantized paged and MLA case of the H100 compile gate
    (`gpu_cases`, 32k-page pools) compiles on the Mosaic kernel. Planned HBM
    bytes (the keys and values the kernel's blocks read) against the minimum
    (each KV byte once per KV head per step): GQA within 1.1x; MLA re-reads
    the latent once per 64-row block of the Q x N query rows (128 heads: 2x),
    no more, and with cluster=True (the row blocks as one cluster, each
    latent block multicast) it too compiles and reads it within 1.1x."""
    mesh = gpu_compile.mesh({"data": 1}, gpu="h100")
    sharding = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
    s = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    B, Q, N, K, D, ps, pps = case.B, case.Q, case.N, case.K, case.D, case.ps, case.pages_per_seq
    P, lens, table = gpu_cases.POOL_PAGES, s((B,), jnp.int32), s((B, pps), jnp.int32)
    if case.kernel == "paged":
      fn = lambda *a: mpa.mosaic_paged_attention(*a, window=case.window)
      args = (s((B, Q, N, D)), s((K, P, ps, D)), s((K, P, ps, case.Dv)), lens, table)
      keys, rereads, width = ps * mpa.pages_per_block(ps), 1, K * (D + case.Dv)
    else:
      R = case.Dv
      fn = lambda *a: mma.mosaic_mla_attention(*a, sm_scale=0.1)
      args = (s((B, Q, N, R)), s((B, Q, N, D - R)), s((P, ps, D)), lens, table)
      keys, rereads, width = mma.KEYS, -(-Q * N // mpa.ROWS), D
    with gpu_compile.lowering(mesh):
      lowered = jax.jit(fn).lower(*args)
    assert "mosaic_gpu" in lowered.as_text()
    lowered.compile()
    planned = rereads * B * -(-case.ctx // keys) * keys * width * 2
    minimum = B * case.ctx * width * 2
    assert planned <= (1.1 if case.kernel == "paged" else rereads) * minimum, planned / minimum
    if case.kernel == "mla":
      with gpu_compile.lowering(mesh):
        lowered = jax.jit(lambda *a: mma.mosaic_mla_attention(*a, sm_scale=0.1, cluster=True)
                          ).lower(*args)
      lowered.compile()
      programs = mma.cluster_blocks(Q * N, True)
      assert programs == rereads or (rereads == 1 and programs == 1)
      assert planned / programs <= 1.1 * minimum, planned / programs / minimum
    smem = (mpa.smem_bytes(D, ps, 2) if case.kernel == "paged" else mma.smem_bytes(D, R, 2))
    assert smem <= mpa.SMEM_BYTES

else:

  def test_older_jax_gets_a_named_error():
    q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"jax >= 0.11 needed"):
      mpa.mosaic_paged_attention(q, pages, pages, jnp.ones((1,), jnp.int32),
                                 jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(NotImplementedError, match=r"jax >= 0.11 needed"):
      mma.mosaic_mla_attention(q[..., :32], q[..., 32:], pages[0], jnp.ones((1,), jnp.int32),
                               jnp.zeros((1, 4), jnp.int32), sm_scale=0.1)
