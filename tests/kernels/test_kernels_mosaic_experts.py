"""Our Mosaic GPU expert kernel (`pallas_kernels.mosaic_grouped_matmul`: the
gate-up fusion, one-byte quantized experts) against a float32 numpy
reference in Mosaic GPU's interpret mode (jax >= 0.11; `TestMosaicExpertsGpu`,
only where a GPU is present, runs the same cases compiled), its H100 compile
at DeepSeek-V3 and GPT-OSS-120B widths, its named errors, and the Engine's
MoE layers on it under the "fused_experts" trial. On jax 0.10 the kernel
refuses by name and the trial's Engine keeps XLA."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU, assert_greedy_is_f32_argmax, compile_moe_step_for_h100
from jaxinfer import Backend, Engine, EngineConfig, SamplingParams, gpu_compile, models, ops
from jaxinfer import presets
from jaxinfer.config import ModelConfig, QuantConfig
from jaxinfer.models import moe_core
from pallas_kernels import mosaic_grouped_matmul as mgm

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
TRIAL = Backend(grouped_matmul="mosaic", trials=("fused_experts",))
LUT_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
CASES = {  # codes (None: plain bf16), block, Out, In, fused, activation, biases, sizes, slots
    "plain": (None, None, 128, 192, False, "silu", False, [5, 0, 70], 3),
    "plain_fused_bias": (None, None, 64, 128, True, "silu", True, [64, 1, 0], 2),
    "fp8_block_gpt_oss": (jnp.float8_e4m3fn, (128, 128), 192, 256, True, "gpt_oss", True,
                          [3, 66, 9], 3),  # Out 192: a partial last block of rows
    "int8_per_row": (jnp.int8, (1, 0), 128, 128, True, "silu", False, [0, 40, 24], 2),
    "fp8_per_tensor": (jnp.float8_e4m3fn, (0, 0), 64, 192, False, "silu", True, [7, 7, 7], 3),
    # GPT-OSS's experts as published: In 320 = 5 steps of 64 values (2880 is 45)
    "mxfp4_gpt_oss": ("mxfp4", (1, 32), 128, 320, True, "gpt_oss", True, [9, 0, 60], 3),
    "nvfp4": ("nvfp4", (1, 16), 64, 128, True, "silu", False, [30, 3, 0], 2),  # scale2 too
    "int4_groups_of_128": ("int4", (1, 128), 64, 256, False, "silu", True, [1, 64, 2], 3),
    "int4_per_row": ("int4", (1, 0), 128, 192, True, "silu", False, [0, 0, 33], 2),
}
PACKED = {"mxfp4": "e2m1", "nvfp4": "e2m1", "int4": "int4"}


def _weight(rng, dtype, block, E, out, d_in):
  """(array, scale, the float32 [E, Out, In] it stands for)."""
  if dtype is None:
    w = jnp.asarray(rng.normal(size=(E, d_in, out)) * 0.1, jnp.bfloat16)
    return w, None, np.asarray(w.astype(jnp.float32)).transpose(0, 2, 1)
  if dtype in PACKED:  # two 4-bit codes a byte, the even column low
    codes = rng.integers(0, 256, (E, out, d_in // 2)).astype(np.uint8)
    bi = block[1] or d_in
    if dtype == "mxfp4":  # E8M0
      scale = rng.integers(118, 124, (E, out, d_in // bi)).astype(np.uint8)
      sf = np.exp2(scale.astype(np.float32) - 127)
    else:
      sf = rng.uniform(0.01, 0.2, (E, out, d_in // bi)).astype(np.float32)
      scale = sf.astype(jnp.float8_e4m3fn) if dtype == "nvfp4" else sf
      sf = np.asarray(jnp.asarray(scale).astype(jnp.float32))
    lut = LUT_E2M1 if dtype != "int4" else np.arange(16, dtype=np.float32) - 16 * (
        np.arange(16) >= 8)
    vals = np.stack([lut[codes & 15], lut[codes >> 4]], -1).reshape(E, out, d_in)
    return jnp.asarray(codes), jnp.asarray(scale), vals * np.repeat(sf, bi, 2)
  if dtype == jnp.int8:
    codes = jnp.asarray(rng.integers(-127, 128, (E, out, d_in)), jnp.int8)
  else:
    codes = jnp.asarray(rng.normal(size=(E, out, d_in)), dtype)
  bo, bi = block[0] or out, block[1] or d_in
  scale = rng.uniform(0.002, 0.05, (E, -(-out // bo), -(-d_in // bi))).astype(np.float32)
  full = np.repeat(np.repeat(scale, bo, 1)[:, :out], bi, 2)[:, :, :d_in]
  return codes, jnp.asarray(scale), np.asarray(codes.astype(jnp.float32)) * full


def _reference(xs, mats, biases, sizes, activation):
  """float32 numpy: each row times its expert's matrices, then the GLU."""
  x = np.asarray(xs.astype(jnp.float32))
  e = np.repeat(np.arange(len(sizes)), sizes)
  ys = []
  for m, b in zip(mats, biases):
    y = np.zeros((x.shape[0], m.shape[1]), np.float32)
    y[:len(e)] = np.einsum("ri,roi->ro", x[:len(e)], m[e]) + (0 if b is None else b[e])
    ys.append(y)
  if len(ys) == 1:
    return ys[0]
  g, u = ys
  if activation == "silu":
    return g / (1 + np.exp(-g)) * u
  g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
  return (u + 1) * g / (1 + np.exp(-1.702 * g))


def _case(name, seed=0):
  dtype, block, out, d_in, fused, act, bias, sizes, slots = CASES[name]
  rng = np.random.default_rng(seed)
  E, R = len(sizes), sum(sizes) + 5  # 5 rows past sum(sizes)
  xs = jnp.asarray(rng.normal(size=(R, d_in)), jnp.bfloat16)
  ws = [_weight(rng, dtype, block, E, out, d_in) for _ in range(1 + fused)]
  bs = [rng.normal(size=(E, out)).astype(np.float32) if bias else None for _ in ws]
  kw = dict(scale=ws[0][1], block=block, bias=None if bs[0] is None else jnp.asarray(bs[0]),
            activation=act, slots=slots, packed=PACKED.get(dtype))
  if fused:
    kw.update(up=ws[1][0], up_scale=ws[1][1], up_bias=None if bs[1] is None else jnp.asarray(bs[1]))
  mats = [w[2] for w in ws]
  if dtype == "nvfp4":  # the per-tensor second level, one per expert
    s2 = [rng.uniform(0.5, 2.0, E).astype(np.float32) for _ in ws]
    kw.update(scale2=jnp.asarray(s2[0]), up_scale2=jnp.asarray(s2[-1]) if fused else None)
    mats = [m * v[:, None, None] for m, v in zip(mats, s2)]
  ref = _reference(xs, mats, bs, sizes, act)
  return (xs, ws[0][0], jnp.asarray(sizes, jnp.int32)), kw, ref


def _gpt_oss_128():
  """The GPT-OSS fixture at widths the kernel tiles (128): biases, clamped GLU."""
  hf = json.loads((FIXTURES / "hf" / "gpt_oss" / "config.json").read_text())
  hf.update(hidden_size=128, intermediate_size=128)
  return dataclasses.replace(ModelConfig.from_hf(hf), max_position_embeddings=512,
                             eos_token_ids=())


ENGINE_MODELS = {  # config, quantization (method, block) or None
    "tiny_moe": (lambda: presets.get("tiny_moe", num_layers=2), None),
    "tiny_moe_fp8_block": (lambda: presets.get("tiny_moe", num_layers=2), ("fp8", (64, 64))),
    "gpt_oss_mxfp4": (_gpt_oss_128, ("mxfp4", (1, 32))),
}


def _engine_model(name, backend):
  make, q = ENGINE_MODELS[name]
  cfg = dataclasses.replace(make(), dtype="bfloat16", backend=backend)
  params = models.init_params(cfg, jax.random.key(0))
  if q is None:
    return cfg, params
  cfg = dataclasses.replace(cfg, quant=QuantConfig(method=q[0], block=q[1]))
  return cfg, models.specs.quantize_params(cfg, params)


if mgm.available() is None:

  class TestMosaicExperts:
    interpret = True

    @pytest.mark.parametrize("name", CASES)
    def test_matches_reference(self, name):
      args, kw, ref = _case(name)
      out = mgm.mosaic_grouped_matmul(*args, interpret=self.interpret, **kw)
      out = np.asarray(out, np.float32)
      assert np.isfinite(out).all() and out.shape == ref.shape
      assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 2e-2
      assert not out[-5:].any()  # rows past sum(group_sizes)

  # One block-quantized and one biased, per-row-scaled model (CI time: every
  # format against the reference is TestMosaicExperts' at the kernel).
  @pytest.mark.parametrize("name", ["tiny_moe_fp8_block", "gpt_oss_mxfp4"])
  def test_engine_moe_layers_run_on_the_fused_kernel(monkeypatch, name):
    """Backend(grouped_matmul="mosaic", trials=("fused_experts",)) on CPU
    (interpreted): the MoE layers' gate-up runs fused on our kernel (and the
    down projection), the stats name it, and every greedy token is the
    argmax of a float32 full forward."""
    calls = []
    real = ops.mosaic_experts
    monkeypatch.setattr(ops, "mosaic_experts", lambda *a, **k: calls.append(k) or real(*a, **k))
    cfg, params = _engine_model(name, TRIAL)
    prompts = [[5, 17, 99], list(range(40, 61))]
    eng = Engine(cfg, params, EngineConfig(page_size=16, num_pages=16, max_num_seqs=2,
                                           max_num_batched_tokens=32))
    outs = eng.generate(prompts, SamplingParams(max_tokens=4))
    assert any(k.get("up") is not None for k in calls), "no fused gate-up call"
    assert any(k.get("up") is None for k in calls), "the down projection did not run on it"
    assert eng.stats()["kernels"]["grouped_matmul"] == "mosaic_fused"
    assert_greedy_is_f32_argmax(cfg, params, prompts, outs)

  @pytest.mark.parametrize("model,E,D,F,mode", [
      ("deepseek_v3", 32, 7168, 2048, "codes"),   # fp8, 128 x 128 blocks, 32 local experts
      ("gpt_oss_120b", 128, 2880, 2880, "plain"),  # bf16, biases, clamped GLU
      ("gpt_oss_120b", 128, 2880, 2880, "e2m1"),   # MXFP4 as published
      ("deepseek_v3", 32, 7168, 2048, "nvfp4"),    # NVIDIA's FP4 DeepSeek-R1: fp8 scales / 16
      ("deepseek_v3", 32, 7168, 2048, "int4"),     # int4, float32 scales / 128
  ])
  def test_fused_gate_up_compiles_for_h100(model, E, D, F, mode):
    mesh = gpu_compile.mesh({"data": 1}, gpu="h100")
    sh = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    w, scale, kw = {
        "codes": ((E, F, D), jnp.float8_e4m3fn, dict(block=(128, 128))),
        "plain": ((E, D, F), jnp.bfloat16, dict(activation="gpt_oss")),
        "e2m1": ((E, F, D // 2), jnp.uint8, dict(block=(1, 32), packed="e2m1",
                                                  activation="gpt_oss")),
        "nvfp4": ((E, F, D // 2), jnp.uint8, dict(block=(1, 16), packed="e2m1")),
        "int4": ((E, F, D // 2), jnp.uint8, dict(block=(1, 128), packed="int4")),
    }[mode], None, None
    w, kw = s(w[0], w[1]), w[2]
    scale = {"codes": s((E, F // 128, D // 128), jnp.float32),
             "e2m1": s((E, F, D // 32), jnp.uint8),
             "nvfp4": s((E, F, D // 16), jnp.float8_e4m3fn),
             "int4": s((E, F, D // 128), jnp.float32)}.get(mode)
    bias = s((E, F), jnp.float32)

    def fused(xs, g, u, sizes, gs, us, bg, bu):
      return mgm.mosaic_grouped_matmul(xs, g, sizes, scale=gs, bias=bg, up=u, up_scale=us,
                                       up_bias=bu, **kw)
    with gpu_compile.lowering(mesh):
      lowered = jax.jit(fused).lower(s((512, D), jnp.bfloat16), w, w, s((E,), jnp.int32),
                                     scale, scale, bias, bias)
    assert "mosaic_gpu" in lowered.as_text()
    lowered.compile()
    assert mgm.smem_bytes(2, "e2m1" if mode == "nvfp4" else mode, 3) <= 227 * 1024

  @pytest.mark.parametrize("model,mesh,layout,program,q", [
      ("deepseek_v3", {"data": 1, "expert": 8}, "dp_attn_ep", "mixed", ("fp8", (128, 128))),
      ("gpt_oss_120b", {"data": 1}, "tp", "decode", ("mxfp4", (1, 32))),
      ("gpt_oss_120b", {"data": 1}, "tp", "decode", None)])
  def test_engine_moe_step_compiles_on_the_fused_kernel_for_h100(monkeypatch, model, mesh,
                                                                 layout, program, q):
    """The trial inside the Engine's step for one H100: DeepSeek-V3 with its
    published fp8 128 x 128 experts under EP 8 (32 local experts), GPT-OSS-120B
    with its published MXFP4 experts and in bf16 (biases, clamped GLU); the
    gate-up runs fused and the down projection on the kernel, and the program
    compiles and fits."""
    calls = []
    real = ops.mosaic_experts
    monkeypatch.setattr(ops, "mosaic_experts",
                        lambda *a, **k: calls.append(k.get("up") is not None) or real(*a, **k))
    quant = {} if q is None else dict(quant=QuantConfig(method=q[0], block=q[1]))
    entry = compile_moe_step_for_h100(model, mesh, layout, program, backend=TRIAL, **quant)
    assert sorted(calls) == [False, True], calls  # one scanned MoE layer: gate-up, down
    assert entry["mosaic_kernels"] >= 2 and entry["fits"], entry

  def test_named_errors():
    bf = jnp.bfloat16
    xs, sizes = jnp.zeros((8, 64), bf), jnp.asarray([8, 0], jnp.int32)
    w = jnp.zeros((2, 64, 64), bf)
    codes, scale = jnp.zeros((2, 64, 64), jnp.int8), jnp.ones((2, 1, 1), jnp.float32)
    f = mgm.mosaic_grouped_matmul
    cases = [
        (lambda: f(xs.astype(jnp.float32), w, sizes), "bfloat16 or float16"),
        (lambda: f(xs, w.astype(jnp.float16), sizes), "weights must be bfloat16"),
        (lambda: f(xs, jnp.zeros((2, 64, 96), bf), sizes), r"multiples of \[64, 64\]"),
        (lambda: f(xs, jnp.zeros((2, 64, 48), jnp.uint8), sizes, block=(1, 32), packed="e2m1"),
         r"\[64, 96\] must be multiples of \[64, 64\]"),
        (lambda: f(xs, jnp.zeros((2, 64, 32), jnp.uint8), sizes, scale=jnp.ones((2, 64, 2)),
                   block=(1, 32), packed="e2m1"), r"e2m1 codes take scales of \[.uint8., .float8_e4m3fn.\]"),
        (lambda: f(xs, jnp.zeros((2, 64, 32), jnp.uint8), sizes, block=(1, 8), packed="e2m1"),
         r"scale blocks \(1, 16 / 32"),
        (lambda: f(xs, jnp.zeros((2, 64, 32), jnp.uint8), sizes, block=(1, 32), packed="nf4"),
         "packed must be one of"),
        (lambda: f(xs, codes, sizes, scale=scale), "scale block"),
        (lambda: f(xs, codes, sizes, scale=scale, block=(32, 32)), "whole 64 x 64 tiles"),
        (lambda: f(xs, codes, sizes, scale=jnp.ones((2, 2, 1)), block=(0, 0)), "scale must be"),
        (lambda: f(xs, w, sizes, bias=jnp.zeros((2, 32))), "bias must be"),
        (lambda: f(xs, w, sizes, up=w, activation="relu"), "activation"),
        (lambda: f(xs, w, sizes, slots=1), "slots"),
        (lambda: f(jnp.zeros((8, 128), bf), w, sizes), r"xs \[R, 64\] and group_sizes"),
        (lambda: f(xs, codes, sizes, scale=scale, block=(0, 0), up=w), "up"),
    ]
    for call, match in cases:
      with pytest.raises(ValueError, match=match):
        call()

  def test_weights_the_kernel_leaves_to_the_others():
    """int4 experts in blocks the kernel does not tile (8 values) and a
    Backend without the trial keep the other kernels: `mosaic_experts_take`
    says no."""
    cfg, params = _engine_model("tiny_moe", TRIAL)
    moe = lambda p: jax.tree.map(lambda a: a[0], p["layers"][1]["mlp"])  # layer 1: MoE
    layer = moe(params)
    assert moe_core.mosaic_experts_take(cfg, layer, jnp.bfloat16)
    plain = dataclasses.replace(cfg, backend=Backend(grouped_matmul="mosaic"))
    assert not moe_core.mosaic_experts_take(plain, layer, jnp.bfloat16)
    q = dataclasses.replace(cfg, quant=QuantConfig(method="int4", block=(1, 8)))
    qlayer = moe(models.specs.quantize_params(q, params))
    assert type(qlayer["w_gate"]).__name__ == "QuantizedWeight"
    assert not moe_core.mosaic_experts_take(q, qlayer, jnp.bfloat16)

else:

  def test_older_jax_refuses_by_name_and_the_trial_keeps_xla():
    xs, w = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="jax >= 0.11"):
      mgm.mosaic_grouped_matmul(xs, w, jnp.asarray([8, 0], jnp.int32))
    cfg, params = _engine_model("tiny_moe", TRIAL)
    eng = Engine(cfg, params, EngineConfig(page_size=16, num_pages=8, max_num_seqs=1))
    assert eng.stats()["kernels"]["grouped_matmul"] == "xla"
    assert len(eng.generate([[5, 17]], SamplingParams(max_tokens=2))[0].token_ids) == 2


if ON_GPU and mgm.available() is None:

  class TestMosaicExpertsGpu(TestMosaicExperts):
    """The same cases compiled on this GPU (Hopper)."""
    interpret = False
