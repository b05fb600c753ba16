"""The weight-only quantized matmul kernel (Pallas interpret mode) against its
float32 reference, and through `layers.linear` in a model forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import models, ops
from jaxinfer.config import QuantConfig
from jaxinfer.models import quant
from pallas_kernels.quantized_matmul import (BlockSizes, quantized_matmul,
                                             quantized_matmul_reference)


@pytest.mark.parametrize("M,N,K,block,method", [
    (5, 576, 256, (128, 128), "fp8"),    # DeepSeek kv_a rows: a partial 128-row block
    (33, 96, 320, (1, 0), "int8"),        # per channel; M, N, K off the tiles
    (1, 200, 128, (0, 0), "fp8"),         # per tensor, one decode row
    (64, 128, 512, (128, 128), "fp8"),
    (16, 64, 96, (32, 32), "int8")])      # scale blocks smaller than a key tile
def test_kernel_matches_reference(M, N, K, block, method):
  rng = np.random.default_rng(M + N)
  codes, scale, _ = quant.quantize_matrix(rng.normal(0, .05, (N, K)).astype(np.float32), method, block)
  x = jnp.asarray(rng.normal(size=(M, K)).astype(np.float32))
  got = quantized_matmul(x, jnp.asarray(codes), jnp.asarray(scale), block=block, interpret=True)
  want = quantized_matmul_reference(x, jnp.asarray(codes), jnp.asarray(scale), block=block)
  assert got.shape == (M, N) and got.dtype == x.dtype
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


def test_bf16_activations():
  rng = np.random.default_rng(3)
  codes, scale, _ = quant.quantize_matrix(rng.normal(0, .05, (128, 256)).astype(np.float32), "fp8",
                                          (128, 128))
  x = jnp.asarray(rng.normal(size=(8, 256)), jnp.bfloat16)
  got = quantized_matmul(x, jnp.asarray(codes), jnp.asarray(scale), block=(128, 128), interpret=True)
  want = quantized_matmul_reference(x, jnp.asarray(codes), jnp.asarray(scale), block=(128, 128))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2,
                             atol=2e-2)


def test_bad_input_is_named():
  x, codes = jnp.ones((4, 64)), jnp.ones((32, 64), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="scale must be \\[1, 1\\]"):
    quantized_matmul(x, codes, jnp.ones((2, 1)), block=(0, 0))
  with pytest.raises(TypeError, match="float8_e4m3fn or int8"):
    quantized_matmul(x, codes.astype(jnp.float32), jnp.ones((1, 1)))
  with pytest.raises(ValueError, match="K=64 inputs, codes 32"):
    quantized_matmul(x, jnp.ones((64, 32), jnp.int8), jnp.ones((1, 1)))
  with pytest.raises(ValueError, match="cannot be tiled"):
    quantized_matmul(x, codes, jnp.ones((1, 8)), block=(0, 8))
  with pytest.raises(ValueError, match="power of two"):
    BlockSizes(block_n=48)


def test_linear_through_the_kernel_equals_xla_dequantization(monkeypatch):
  """A forward whose quantized projections are marked for the kernel (as the
  Engine marks them) equals the XLA-dequantized forward, the kernel run
  interpreted in place of the GPU one."""
  cfg = jaxinfer.presets.get("tiny_moe")
  qcfg = dataclasses.replace(cfg, quant=QuantConfig(method="fp8", block=(32, 32)))
  qp = models.specs.quantize_params(qcfg, models.init_params(cfg, jax.random.key(0)))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)))
  want = models.logits(qcfg, qp, tokens)
  calls = []
  real = ops.quantized_matmul

  def interpreted(*a, **kw):
    calls.append(a[1].shape)
    return real(*a, **dict(kw, target="cpu"))

  monkeypatch.setattr(ops, "resolve", lambda impl, target=None: ("pallas", True))
  monkeypatch.setattr(ops, "quantized_matmul", interpreted)
  got = models.logits(qcfg, quant.with_kernel(qp), tokens)
  assert calls  # the projections went through the kernel
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("M,N,K,block,dtype", [
    (8, 576, 7168, (128, 128), jnp.float8_e4m3fn),     # DeepSeek-V3 kv_a_proj, decode
    (256, 24576, 1536, (128, 128), jnp.float8_e4m3fn),  # q_b_proj, a prefill chunk
    (4, 53248, 16384, (1, 0), jnp.float8_e4m3fn),      # Llama-3.1-405B FP8 gate, per channel
    (64, 4096, 4096, (1, 0), jnp.int8)])
def test_kernel_compiles_for_h100_at_serving_shapes(M, N, K, block, dtype):
  import functools
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxinfer import gpu_compile
  sh = NamedSharding(gpu_compile.mesh({"data": 1}), P())
  bo, bi = block[0] or N, block[1] or K
  args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=sh),
          jax.ShapeDtypeStruct((N, K), dtype, sharding=sh),
          jax.ShapeDtypeStruct((-(-N // bo), -(-K // bi)), jnp.float32, sharding=sh))
  compiled = jax.jit(functools.partial(quantized_matmul, block=block)).lower(*args).compile()
  assert "__gpu$xla.gpu.triton" in compiled.as_text()
  mem = gpu_compile.MemoryReport.of(compiled)
  # Scratch is the padded activations and the per-tile scales: never a float copy of W.
  assert mem.temp_bytes < 0.05 * N * K * 2, mem.temp_bytes


@pytest.mark.parametrize("R,sizes,block,method", [
    (10, [3, 0, 5, 1], (16, 16), "fp8"),   # an empty expert, rows past the groups
    (40, [17, 0, 20], (1, 0), "int8"),      # groups over one row tile
    (7, [0, 0], (0, 0), "fp8")])            # nothing routed: all zeros
def test_grouped_kernel_matches_ragged_dot_reference(R, sizes, block, method):
  from pallas_kernels.quantized_matmul import (quantized_grouped_matmul,
                                               quantized_grouped_matmul_reference)
  rng = np.random.default_rng(R)
  E, N, K = len(sizes), 48, 64
  codes, scale, _ = quant.quantize_matrix(rng.normal(0, .05, (E, N, K)).astype(np.float32), method,
                                          block)
  x = jnp.asarray(rng.normal(size=(R, K)).astype(np.float32))
  gs = jnp.asarray(sizes, jnp.int32)
  args = (x, jnp.asarray(codes), jnp.asarray(scale), gs)
  got = quantized_grouped_matmul(*args, block=block, interpret=True)
  want = quantized_grouped_matmul_reference(*args, block=block)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(float(jnp.abs(want).max()), 1))
  assert not np.any(np.asarray(got)[sum(sizes):])


@pytest.mark.parametrize("R,E,N,K", [(64, 32, 2048, 7168), (512, 32, 7168, 2048)])
def test_grouped_kernel_compiles_for_h100_at_deepseek_expert_shapes(R, E, N, K):
  """One rank's 32 DeepSeek-V3 experts (gate / down projections), 128-blocks."""
  import functools
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxinfer import gpu_compile
  from pallas_kernels.quantized_matmul import quantized_grouped_matmul
  sh = NamedSharding(gpu_compile.mesh({"data": 1}), P())
  S = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sh)
  args = (S((R, K), jnp.bfloat16), S((E, N, K), jnp.float8_e4m3fn),
          S((E, N // 128, K // 128), jnp.float32), S((E,), jnp.int32))
  compiled = jax.jit(functools.partial(quantized_grouped_matmul, block=(128, 128))).lower(
      *args).compile()
  assert "__gpu$xla.gpu.triton" in compiled.as_text()
  mem = gpu_compile.MemoryReport.of(compiled)
  assert mem.temp_bytes < 0.1 * E * N * K * 2, mem.temp_bytes  # never a bf16 copy of the experts
