"""Model behaviour: cached == full forward, grouped MoE == dense MoE, input errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, HF_FIXTURES
from jaxinfer import ModelConfig, models, presets
from jaxinfer.models.layouts import FusedQKV, WeightForm

ARCH_CONFIGS = {
    "tiny_dense": presets.get("tiny_dense"),
    "tiny_moe": presets.get("tiny_moe"),
    **{n: ModelConfig.from_hf(__import__("json").loads((FIXTURES / "hf" / n / "config.json").read_text()))
       for n in HF_FIXTURES if n != "llama_sharded"},
}


def _rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _setup(cfg, seed=0, B=2, T=11):
  cfg = dataclasses.replace(cfg, dtype="float32")
  params = models.init_params(cfg, jax.random.key(seed))
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
  return cfg, params, tokens


@pytest.mark.parametrize("name", sorted(ARCH_CONFIGS))
def test_cached_prefill_then_decode_equals_full_forward(name):
  cfg, params, tokens = _setup(ARCH_CONFIGS[name])
  full = models.logits(cfg, params, tokens)
  cache = models.init_cache(cfg, tokens.shape[0], 16)
  # Prefill in two chunks, then decode token by token.
  out1, cache = models.forward(cfg, params, tokens[:, :4], cache)
  out2, cache = models.forward(cfg, params, tokens[:, 4:7], cache)
  steps = [out1, out2]
  for t in range(7, tokens.shape[1]):
    out, cache = models.forward(cfg, params, tokens[:, t:t + 1], cache)
    steps.append(out)
  assert _rel(jnp.concatenate(steps, axis=1), full) < 1e-5
  assert np.array_equal(np.asarray(cache["lengths"]), [tokens.shape[1]] * tokens.shape[0])


def test_mla_cache_holds_compressed_latent():
  cfg = presets.get("tiny_moe")
  cache = models.init_cache(cfg, 3, 32)
  for seg in cache["layers"]:
    assert set(seg) == {"kv"}
    assert seg["kv"].shape[1:] == (3, 32, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


@pytest.mark.parametrize("name", ["tiny_moe", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_grouped_moe_equals_dense_moe(name):
  cfg, params, tokens = _setup(ARCH_CONFIGS[name], seed=3)
  grouped = models.logits(dataclasses.replace(cfg, moe_impl="grouped"), params, tokens)
  dense = models.logits(dataclasses.replace(cfg, moe_impl="dense"), params, tokens)
  assert _rel(grouped, dense) < 1e-5


def test_layers_are_stacked_and_scanned():
  cfg = presets.get("deepseek_v3", num_layers=5, dense_layers=(0, 1))
  specs = models.param_specs(cfg)
  assert [n for _, _, n in cfg.segments()] == [2, 3]
  assert specs["layers"][1]["mlp"]["w_gate"].shape[:2] == (3, cfg.num_experts)
  assert specs["layers"][0]["attn"]["wkv_a"].logical_axes[0] == "layers"


def test_sliding_window_changes_output():
  cfg, params, tokens = _setup(ARCH_CONFIGS["gpt_oss"], T=12)
  full = models.logits(cfg, params, tokens)
  no_window = models.logits(dataclasses.replace(cfg, sliding_window=0, layer_types=()), params, tokens)
  # Positions inside the window agree; later ones differ.
  w = cfg.sliding_window
  assert _rel(full[:, :w], no_window[:, :w]) < 1e-6
  assert _rel(full[:, w + 1:], no_window[:, w + 1:]) > 1e-4


def test_init_params_is_deterministic_and_seeded():
  cfg = presets.get("tiny_dense")
  a, b = models.init_params(cfg, jax.random.key(0)), models.init_params(cfg, jax.random.key(0))
  c = models.init_params(cfg, jax.random.key(1))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert not np.array_equal(a["embed"], c["embed"])
  assert a["embed"].dtype == jnp.float32  # CPU default


@pytest.mark.parametrize("tokens,exc,match", [
    (np.zeros((4,), np.int32), ValueError, "2-D"),
    (np.zeros((1, 4), np.float32), TypeError, "integer"),
    (np.full((1, 4), 256, np.int32), ValueError, r"\[0, 256\)"),
    (np.full((1, 4), -1, np.int32), ValueError, "ids must be"),
    (np.zeros((1, 0), np.int32), ValueError, "non-empty"),
])
def test_bad_tokens_raise(tokens, exc, match):
  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  with pytest.raises(exc, match=match):
    models.logits(cfg, params, tokens)


def test_prompt_over_context_and_cache_overflow_raise():
  cfg = presets.get("tiny_dense", max_position_embeddings=8)
  params = models.init_params(cfg, jax.random.key(0))
  with pytest.raises(ValueError, match="exceeds the context"):
    models.logits(cfg, params, np.zeros((1, 9), np.int32))
  cache = models.init_cache(cfg, 1, 8)
  _, cache = models.forward(cfg, params, np.zeros((1, 6), np.int32), cache)
  with pytest.raises(ValueError, match="overflow the cache"):
    models.forward(cfg, params, np.zeros((1, 3), np.int32), cache)
  with pytest.raises(ValueError, match="batch"):
    models.forward(cfg, params, np.zeros((2, 1), np.int32), cache)


# (split_experts, transposed, float layout); "gpu": untransposed with q, k and
# v fused by KV head, the GPU Engine's form (`weight_layout.choose`).
_LAYOUTS = [(False, False, "gpu"), (True, True, "out_in"), (False, True, "out_major"),
            (True, True, "in_out"), (True, True, "panels")]


def _form(split_experts, transpose, float_layout):
  return WeightForm(split_experts=split_experts, transposed=transpose,
                    floats_in_out=float_layout == "in_out", out_major=float_layout == "out_major",
                    panels=float_layout == "panels", fused_qkv=float_layout == "gpu")
# Every layout for the MoE + MLA, biased and plain MoE archs; the others take
# the two ends and the panels (CI time: each case compiles four programs).
_STEP_LAYOUT_CASES = [(name, *layout) for name in sorted(ARCH_CONFIGS)
                      for layout in (_LAYOUTS if name in ("tiny_moe", "deepseek_v3", "gpt_oss")
                                     else [_LAYOUTS[0], _LAYOUTS[3], _LAYOUTS[4]])]


@pytest.mark.parametrize("name,split_experts,transpose,float_layout", _STEP_LAYOUT_CASES)
def test_step_layout_equals_stacked(name, split_experts, transpose, float_layout):
  """The engine's CPU layout (per-layer weights, fused gate/up and q/k/v, MLA's
  up-projections transposed, experts split, projections packed) computes
  the same logits, full and cached; the split expert path with T tokens
  covers prefill chunks (several rows per expert) as well as decode."""
  from jaxinfer.models import transformer
  from jaxinfer.models.layers import PackedLinear
  cfg, params, tokens = _setup(ARCH_CONFIGS[name], seed=5, T=13)
  step = transformer.step_layout(cfg, params, _form(split_experts, transpose, float_layout))
  assert all(isinstance(seg, tuple) for seg in step["layers"])
  attn = step["layers"][0][0]["attn"]
  # Grouped-query q, k and v become one matmul whenever the step transposes
  # (grouped by KV head in the GPU form), and so do MLA's two
  # down-projections (q LoRA and the latent's) when transposed.
  gpu = float_layout == "gpu"
  assert isinstance(attn, FusedQKV) == ((transpose or gpu) and not cfg.attention.latent)
  if isinstance(attn, FusedQKV):
    N, K, H = attn.heads
    assert attn.grouped == gpu
    if gpu:
      assert attn.wqkv.shape[1:] == (K, N // K + 2, H)
  fused_mla = transpose and cfg.attention.latent and bool(cfg.q_lora_rank)
  assert ("wqkv_a" in attn) == fused_mla
  if cfg.attention.latent:
    assert ("wkv_a" in attn) != fused_mla
  packed = [w for w in attn.values() if isinstance(w, PackedLinear)]
  assert bool(packed) == (transpose and float_layout != "in_out")
  assert all(w.out_major == (float_layout == "out_major") for w in packed)
  assert all(w.panels == (float_layout == "panels") for w in packed)
  if transpose and float_layout != "in_out":
    head = step.get("lm_head", PackedLinear(None, (), (), float_layout == "out_major",
                                            float_layout == "panels"))
    assert isinstance(head, PackedLinear) and head.out_major == (float_layout == "out_major")
    assert head.panels == (float_layout == "panels")
  if split_experts and cfg.is_moe:
    moe_layer = next(layer for seg in step["layers"] for layer in seg if "router" in layer["mlp"])
    assert len(moe_layer["mlp"]["w_down"]) == cfg.num_experts
  want = models.logits(cfg, params, tokens)
  got = transformer._logits(cfg, step, jnp.asarray(tokens), None)
  assert _rel(got, want) < 1e-5
  cache = models.init_cache(cfg, tokens.shape[0], 16)
  out1, cache = transformer._forward(cfg, step, jnp.asarray(tokens[:, :9]), cache, None)
  out2, cache = transformer._forward(cfg, step, jnp.asarray(tokens[:, 9:10]), cache, None)
  assert _rel(jnp.concatenate([out1, out2], axis=1), want[:, :10]) < 1e-5
  with pytest.raises(ValueError, match="already in the step layout"):
    transformer.step_layout(cfg, step)
  with pytest.raises(ValueError, match="floats_in_out must be a bool"):
    WeightForm(floats_in_out="rows")
  with pytest.raises(ValueError, match="pick one"):
    WeightForm(floats_in_out=True, out_major=True)
  with pytest.raises(ValueError, match="pick one"):
    WeightForm(out_major=True, panels=True)


@pytest.mark.parametrize("name", sorted(ARCH_CONFIGS))
def test_stacked_layout_inverts_step_layout(name):
  """`stacked_layout(step_layout(p))` is p, leaf for leaf and bit for bit,
  for every layout option (what `Engine.params` rebuilds from)."""
  from jaxinfer.models import transformer
  cfg, params, _ = _setup(ARCH_CONFIGS[name], seed=6, T=2)
  for split_experts, transpose, layout in _LAYOUTS:
    step = transformer.step_layout(cfg, params, _form(split_experts, transpose, layout))
    back = transformer.stacked_layout(cfg, step)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for (path, want), got in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(back)):
      assert got.shape == want.shape and got.dtype == want.dtype, jax.tree_util.keystr(path)
      np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
  with pytest.raises(ValueError, match="already stacked"):
    transformer.stacked_layout(cfg, params)


@pytest.mark.parametrize("rows", [(1, 1), (2, 3)], ids=["lone_row", "rows"])
def test_rms_scaled_linear_equals_the_norm_then_the_matmul(rows):
  """The GPU form's norm (`layers.rms_scaled`, the row scale applied to the
  product; a lone row's squares summed in 128-wide chunks) and the gated
  MLP reading it equal `rms_norm` then the matmul, into several out dims
  too; an RmsScaled contracts one dim only."""
  from jaxinfer.models import layers
  from jaxinfer.models.layouts import FusedMLP
  rng = np.random.default_rng(7)
  D = 384  # three chunks of 128
  x = jnp.asarray(rng.standard_normal((*rows, D)), jnp.float32)
  g = jnp.asarray(rng.standard_normal(D), jnp.float32)
  w = jnp.asarray(rng.standard_normal((D, 2, 3, 5)), jnp.float32)
  scaled = jax.jit(layers.rms_scaled, static_argnums=2)(x, g, 1e-5)
  want = jnp.tensordot(layers.rms_norm(x, g, 1e-5), w, axes=1)
  got = layers.linear(scaled, w)
  assert got.shape == want.shape and got.dtype == want.dtype
  assert _rel(got, want) < 1e-6
  cfg = presets.get("tiny_dense")
  mlp = FusedMLP(w_gate_up=jnp.asarray(rng.standard_normal((D, 16)), jnp.float32),
                 w_down=jnp.asarray(rng.standard_normal((8, D)), jnp.float32))
  assert _rel(layers.mlp(cfg, mlp, scaled), layers.mlp(cfg, mlp, layers.rms_norm(x, g, 1e-5))) < 1e-6
  with pytest.raises(ValueError, match="in_dims"):
    layers.linear(scaled, w, in_dims=2)


@pytest.mark.parametrize("shape,in_dims", [((6, 10), 1), ((4, 3, 5), 2), ((6, 2, 5), 1),
                                           ((6, 2), 1)])
def test_packed_linear_equals_tensordot(shape, in_dims):
  """`linear` over a packed (transposed) weight with several in/out dims
  equals the plain contraction; bad in_dims are refused."""
  from jaxinfer.models.layers import linear, pack_linear
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
  x = jnp.asarray(rng.standard_normal((2, 3, *shape[:in_dims]), dtype=np.float32))
  packed = pack_linear(w, in_dims)
  assert packed.wt.shape == (int(np.prod(shape[in_dims:])), int(np.prod(shape[:in_dims])))
  want = jnp.tensordot(x, w, axes=in_dims)
  got = jax.jit(linear, static_argnums=2)(x, packed, in_dims)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="in_dims"):
    pack_linear(w, len(shape))


@pytest.mark.parametrize("shape,in_dims", [((6, 10), 1), ((4, 3, 5), 2), ((64, 6, 8), 1)])
def test_panels_linear_equals_tensordot_on_the_native_kernel(shape, in_dims):
  """A float32 `PackedLinear` in panels: `linear` equals the plain
  contraction at decode and prefill row counts, through the C++ kernel's
  custom call; `unpack_linear` gives the weight back bit for bit; other
  dtypes stay [Out, In]."""
  from jaxinfer.models.layers import linear, pack_linear, unpack_linear
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
  packed = pack_linear(w, in_dims, panels=True)
  In, Out = int(np.prod(shape[:in_dims])), int(np.prod(shape[in_dims:]))
  assert packed.panels and packed.wt.shape == (-(-Out // 32), In, 32)
  np.testing.assert_array_equal(unpack_linear(packed), w)
  for lead in [(1,), (2, 4), (37,)]:
    x = jnp.asarray(rng.standard_normal((*lead, *shape[:in_dims]), dtype=np.float32))
    f = jax.jit(linear, static_argnums=2)
    got = f(x, packed, in_dims)
    np.testing.assert_allclose(got, jnp.tensordot(x, w, axes=in_dims), rtol=1e-5, atol=1e-5)
    assert "jaxinfer_panel_matmul" in f.lower(x, packed, in_dims).as_text()
  half = pack_linear(w.astype(jnp.bfloat16), in_dims, panels=True)
  assert not half.panels and half.wt.shape == (Out, In)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_out_major_linear_multiplies_into_out_by_rows(dtype):
  """A `PackedLinear` with out_major: x [..., In] x w equals the plain
  matmul, and the compiled dot's product is [Out, rows] (weight on the
  left; the barrier keeps XLA from folding the transpose back into it)."""
  from jaxinfer.models.layers import linear, pack_linear
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((2, 4, 64)), dtype)
  w = jnp.asarray(r.standard_normal((64, 6, 8)), dtype)
  packed = pack_linear(w, out_major=True)
  y = jax.jit(linear)(x, packed)
  assert y.shape == (2, 4, 6, 8) and y.dtype == x.dtype
  want = jnp.einsum("bti,ihd->bthd", x.astype(jnp.float32), w.astype(jnp.float32))
  tol = 1e-5 if dtype == "float32" else 2e-2
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=tol, atol=tol)
  hlo = jax.jit(linear).lower(x, packed).compile().as_text()
  assert re.search(r"f32\[48,8\][^\n]*dot\(", hlo), "the dot does not produce [Out, rows]"
  # Past OUT_MAJOR_MAX_ROWS rows: rows x wt^T, same numbers.
  from jaxinfer.models.layers import OUT_MAJOR_MAX_ROWS
  big = jnp.asarray(r.standard_normal((OUT_MAJOR_MAX_ROWS + 8, 64)), dtype)
  np.testing.assert_allclose(
      np.asarray(jax.jit(linear)(big, packed), np.float32),
      np.asarray(jnp.einsum("ti,ihd->thd", big.astype(jnp.float32), w.astype(jnp.float32))),
      rtol=tol, atol=tol)
  hlo = jax.jit(linear).lower(big, packed).compile().as_text()
  assert f"f32[48,{OUT_MAJOR_MAX_ROWS + 8}]" not in hlo


def test_split_experts_never_run_padding_tokens():
  """The split expert path (the Engine's CPU layout) sends a step's padding
  tokens (valid False) to no expert: with NaN padding rows and no shared
  expert their output is exactly zero (run through an expert it would be
  NaN), and the valid rows equal the same tokens without padding."""
  from jaxinfer.models import moe, transformer
  cfg = dataclasses.replace(presets.get("tiny_moe"), num_shared_experts=0)
  params = models.init_params(cfg, jax.random.key(3))
  step = transformer.step_layout(cfg, params, WeightForm(split_experts=True))
  p = next(layer for seg in step["layers"] for layer in seg if "router" in layer["mlp"])["mlp"]
  x = jax.random.normal(jax.random.key(4), (1, 12, cfg.d_model), jnp.float32)
  valid = jnp.arange(12)[None] < 9
  padded = jnp.where(valid[..., None], x, jnp.nan)
  got, _ = moe.moe(cfg, p, padded, valid=valid)
  want, _ = moe.moe(cfg, p, x[:, :9])
  np.testing.assert_array_equal(np.asarray(got[:, 9:]), 0.0)
  np.testing.assert_allclose(got[:, :9], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 40, 200])
@pytest.mark.parametrize("padded", [False, True])
def test_native_cpu_experts_equal_the_xla_loop(monkeypatch, tokens, padded):
  """The split layout's two CPU paths (`moe.experts_native`, the C++ kernel,
  and `moe.experts_split`, XLA's loop) give the same layer outputs, with
  and without padding tokens; each path is forced, and the native one is
  checked to have run (the kernel's custom call is in the program)."""
  from jaxinfer import ops
  from jaxinfer.models import moe, transformer
  cfg = presets.get("tiny_moe")
  params = models.init_params(cfg, jax.random.key(5))
  step = transformer.step_layout(cfg, params, WeightForm(split_experts=True, native_experts=True))
  p = next(layer for seg in step["layers"] for layer in seg if "router" in layer["mlp"])["mlp"]
  x = jax.random.normal(jax.random.key(6), (1, tokens, cfg.d_model), jnp.float32)
  valid = jnp.arange(tokens)[None] < max(1, tokens - 2) if padded else None
  layer = lambda x: moe.moe(cfg, p, x, valid=valid)[0]
  monkeypatch.setattr(ops, "CPU_EXPERTS", True)
  monkeypatch.setattr(ops, "CPU_EXPERT_ROWS", 10 ** 6)  # also without the AVX-512 tiles
  native = jax.jit(lambda x: layer(x))  # a function of its own: jit caches traces per function
  assert "jaxinfer_split_experts" in native.lower(x).as_text()
  got = native(x)
  monkeypatch.setattr(ops, "CPU_EXPERTS", False)
  xla = jax.jit(lambda x: layer(x))
  assert "jaxinfer_split_experts" not in xla.lower(x).as_text()
  np.testing.assert_allclose(got, xla(x), atol=2e-5, rtol=2e-5)
