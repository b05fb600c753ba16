"""The weight-only quantized matmul kernel (Pallas interpret mode) against its
float32 reference, and through `layers.linear` in a model forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jaxinfer
from conftest import ON_GPU
from jaxinfer import Backend, models, ops, sharding
from jaxinfer.config import QuantConfig
from jaxinfer.models import quant
from pallas_kernels.quantized_grouped_matmul import (quantized_grouped_matmul,
                                                     quantized_grouped_matmul_reference)
from pallas_kernels.quantized_matmul import (BlockSizes, dequantize_reference, fit,
                                             quantized_matmul, quantized_matmul_reference)


# Interpret mode everywhere; compiled ("Gpu" in the test id) where this process
# has a GPU (experiments/gpu_day.py selects those with -k Gpu).
MODES = pytest.mark.parametrize("interpret", [True] + ([False] if ON_GPU else []),
                                ids=lambda i: "interpret" if i else "Gpu")


def _kernel_args(w, method, block):
  """A float [..., N, K] matrix quantized -> (codes, scale, kwargs) for the kernels."""
  codes, scale, scale2 = quant.quantize_matrix(w, method, block)
  block = quant.FIXED_BLOCKS.get(method, block)
  kw = dict(block=block, packed=quant.PACKING.get(method),
            scale2=None if scale2 is None else jnp.asarray(scale2))
  return jnp.asarray(codes), jnp.asarray(scale), kw


@pytest.mark.parametrize("M,N,K,block,method", [
    (5, 576, 256, (128, 128), "fp8"),    # DeepSeek kv_a rows: a partial 128-row block
    (33, 96, 320, (1, 0), "int8"),        # per channel; M, N, K off the tiles
    (1, 200, 128, (0, 0), "fp8"),         # per tensor, one decode row
    (64, 128, 512, (128, 128), "fp8"),
    (16, 64, 96, (32, 32), "int8"),       # scale blocks smaller than a key tile
    (16, 64, 256, (1, 8), "fp8"),         # 8-input blocks: broadcast inside the tile
    (3, 96, 256, (0, 0), "mxfp4"),        # packed e2m1, E8M0 per 32 inputs
    (17, 64, 320, (0, 0), "nvfp4"),       # packed e2m1, e4m3 per 16 inputs, scale2
    (4, 80, 192, (1, 0), "int4"),         # packed int4 per channel
    (9, 128, 256, (64, 64), "int4")])     # packed int4 in 64-blocks
@MODES
def test_kernel_matches_reference(M, N, K, block, method, interpret):
  rng = np.random.default_rng(M + N)
  codes, scale, kw = _kernel_args(rng.normal(0, .05, (N, K)).astype(np.float32), method, block)
  x = jnp.asarray(rng.normal(size=(M, K)).astype(np.float32))
  got = quantized_matmul(x, codes, scale, **kw, interpret=interpret)
  want = quantized_matmul_reference(x, codes, scale, **kw)
  assert got.shape == (M, N) and got.dtype == x.dtype
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


def test_reference_dequantizes_like_the_model():
  """The kernels' reference (table lookups) and `models.quant` (bitcasts)
  agree on every format: two independent decodings of the same bytes (to
  the rounding of NVFP4's two scale products)."""
  rng = np.random.default_rng(0)
  w = rng.normal(0, .05, (2, 48, 64)).astype(np.float32)
  for method in quant.METHODS:
    qw = quant.quantize(np.swapaxes(w, 1, 2), method, (16, 32), lead=1)
    codes, scale, kw = _kernel_args(w, method, (16, 32))
    ref = dequantize_reference(codes, scale, **kw)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(quant.matmul_weight(qw, jnp.float32)),
                               rtol=3e-7, atol=0, err_msg=method)


@MODES
def test_bf16_activations(interpret):
  rng = np.random.default_rng(3)
  codes, scale, _ = quant.quantize_matrix(rng.normal(0, .05, (128, 256)).astype(np.float32), "fp8",
                                          (128, 128))
  x = jnp.asarray(rng.normal(size=(8, 256)), jnp.bfloat16)
  got = quantized_matmul(x, jnp.asarray(codes), jnp.asarray(scale), block=(128, 128),
                         interpret=interpret)
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
    quantized_matmul(x, codes, jnp.ones((1, 3)), block=(0, 24))
  with pytest.raises(ValueError, match="packed must be one of"):
    quantized_matmul(x, codes, jnp.ones((1, 1)), packed="fp4")
  with pytest.raises(TypeError, match="packed codes must be uint8"):
    quantized_matmul(x, jnp.ones((32, 32), jnp.int8), jnp.ones((1, 1)), packed="int4")
  with pytest.raises(ValueError, match="x has K=64 inputs, codes 128"):
    quantized_matmul(x, jnp.ones((32, 64), jnp.uint8), jnp.ones((1, 1)), packed="e2m1")
  with pytest.raises(ValueError, match="scale2 must be a scalar"):
    quantized_matmul(x, codes, jnp.ones((1, 1)), scale2=jnp.ones(2))
  with pytest.raises(TypeError, match="scale dtype"):
    quantized_matmul(x, codes, jnp.ones((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="power of two"):
    BlockSizes(block_n=48)


@pytest.mark.parametrize("N,K,block,packed", [
    (576, 7168, (128, 128), None), (24576, 1536, (128, 128), None), (53248, 16384, (1, 0), None),
    (5760, 2880, (1, 32), "e2m1"), (2048, 7168, (1, 16), "e2m1"), (4096, 4096, (1, 0), "int4")])
def test_model_dims_are_tiled_in_place(N, K, block, packed):
  """Seed-model projections (DeepSeek-V3, Llama-405B, GPT-OSS experts) need no
  padded copy of their codes: the tiles divide N and K."""
  bo, bi = block[0] or N, block[1] or K
  t = fit(BlockSizes(), 8, N, K, bo, bi, packed, False)
  assert N % t.bn == 0 and K % t.bk == 0 and t.bk >= 64, t


def _interpret_kernels(monkeypatch):
  """The quantized kernels run interpreted where the GPU ones would; -> call counts."""
  calls = {"quantized_matmul": 0, "quantized_grouped_matmul": 0}
  for name in calls:
    real = getattr(ops, name)

    def interpreted(*a, _real=real, _name=name, **kw):
      calls[_name] += 1
      return _real(*a, **dict(kw, backend=Backend(target="cpu")))

    monkeypatch.setattr(ops, name, interpreted)
  # Every backend but an explicit CPU target reads as a GPU one, its kernels interpreted.
  monkeypatch.setattr(Backend, "on_gpu", lambda self: self.target != "cpu")
  monkeypatch.setattr(Backend, "attention_kernel", lambda self: ("pallas", True))
  return calls


def _quantized_tiny_moe(method, block):
  cfg = jaxinfer.presets.get("tiny_moe")
  qcfg = dataclasses.replace(cfg, quant=QuantConfig(method=method, block=block))
  qp = models.specs.quantize_params(qcfg, models.init_params(cfg, jax.random.key(0)))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)))
  return qcfg, qp, tokens


@pytest.mark.parametrize("method,block", [("fp8", (32, 32)), ("nvfp4", (0, 0))])
def test_forward_through_the_kernels_equals_xla_dequantization(monkeypatch, method, block):
  """A forward whose quantized weights are marked for the kernels (as the
  Engine marks them) equals the XLA-dequantized forward, the kernels run
  interpreted in place of the GPU ones: projections and grouped experts."""
  qcfg, qp, tokens = _quantized_tiny_moe(method, block)
  want = models.logits(qcfg, qp, tokens)
  calls = _interpret_kernels(monkeypatch)
  got = models.logits(qcfg, quant.with_kernel(qp), tokens)
  assert all(calls.values()), calls  # projections and experts went through the kernels
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("method,block", [("fp8", (32, 32)), ("nvfp4", (0, 0))])
def test_tensor_parallel_weights_run_the_kernels_per_device(monkeypatch, method, block):
  """Under the tp layout each weight is marked with its split (column- and
  row-parallel projections, experts split on their FFN width), and the
  kernels run per device in shard_map: the forward on 8 CPU devices equals
  the single-device XLA forward."""
  qcfg, qp, tokens = _quantized_tiny_moe(method, block)
  want = models.logits(qcfg, qp, tokens)
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  marked = quant.with_kernel(sharding.shard_params(qcfg, qp, mesh, "tp"), mesh)
  plans = {(w.kernel.out_axis, w.kernel.in_axis) for w in jax.tree.leaves(
      marked, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
      if isinstance(w, quant.QuantizedWeight)}
  assert plans == {(None, None), ("tensor", None), (None, "tensor")}, plans
  calls = _interpret_kernels(monkeypatch)
  got = models.logits(qcfg, marked, tokens)
  assert all(calls.values()), calls
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("M,N,K,block,method", [
    (8, 576, 7168, (128, 128), "fp8"),     # DeepSeek-V3 kv_a_proj, decode
    (256, 24576, 1536, (128, 128), "fp8"),  # q_b_proj, a prefill chunk
    (4, 53248, 16384, (1, 0), "fp8"),      # Llama-3.1-405B FP8 gate, per channel
    (64, 4096, 4096, (1, 0), "int8"),
    (8, 24576, 1536, (0, 0), "nvfp4"),     # DeepSeek-R1 NVFP4 q_b_proj
    (8, 5760, 2880, (0, 0), "mxfp4"),      # a GPT-OSS-sized MXFP4 projection
    (16, 4096, 4096, (128, 128), "int4")])
def test_kernel_compiles_for_h100_at_serving_shapes(M, N, K, block, method):
  import functools
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxinfer import gpu_compile
  mesh = gpu_compile.mesh({"data": 1})
  sh = NamedSharding(mesh, P())
  block = quant.FIXED_BLOCKS.get(method, block)
  bo, bi = block[0] or N, block[1] or K
  S = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sh)
  args = [S((M, K), jnp.bfloat16), S((N, quant.stored_in(method, K)), quant.VALUE_DTYPES[method]),
          S((-(-N // bo), -(-K // bi)), quant.SCALE_DTYPES[method])]
  kw = dict(block=block, packed=quant.PACKING.get(method))
  if method == "nvfp4":
    args.append(S((), jnp.float32))
  fn = lambda x, c, s, s2=None: quantized_matmul(x, c, s, scale2=s2, **kw)
  with gpu_compile.lowering(mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  assert "__gpu$xla.gpu.triton" in compiled.as_text()
  mem = gpu_compile.MemoryReport.of(compiled)
  # Scratch is the activations padded to whole row tiles and the output: no
  # copy of W (float or padded; a bf16 W is N * K * 2 bytes).
  Mp = max(16, pl.next_power_of_2(M))
  assert mem.temp_bytes <= Mp * (K + N) * 2 < N * K, mem.temp_bytes


@pytest.mark.parametrize("R,sizes,block,method", [
    (10, [3, 0, 5, 1], (16, 16), "fp8"),   # an empty expert, rows past the groups
    (40, [17, 0, 20], (1, 0), "int8"),      # groups over one row tile
    (7, [0, 0], (0, 0), "fp8"),             # nothing routed: all zeros
    (12, [5, 0, 7], (0, 0), "mxfp4"),       # GPT-OSS's format
    (20, [2, 9, 9], (0, 0), "nvfp4"),       # a per-expert scale2
    (9, [4, 5], (16, 0), "int4")])
@MODES
def test_grouped_kernel_matches_ragged_dot_reference(R, sizes, block, method, interpret):
  rng = np.random.default_rng(R)
  E, N, K = len(sizes), 48, 64
  codes, scale, kw = _kernel_args(rng.normal(0, .05, (E, N, K)).astype(np.float32), method, block)
  x = jnp.asarray(rng.normal(size=(R, K)).astype(np.float32))
  args = (x, codes, scale, jnp.asarray(sizes, jnp.int32))
  got = quantized_grouped_matmul(*args, **kw, interpret=interpret)
  want = quantized_grouped_matmul_reference(*args, **kw)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(float(jnp.abs(want).max()), 1))
  assert not np.any(np.asarray(got)[sum(sizes):])


@pytest.mark.parametrize("R,E,N,K,method", [
    (64, 32, 2048, 7168, "fp8"), (512, 32, 7168, 2048, "fp8"),  # one rank's DeepSeek-V3 experts
    (64, 32, 2048, 7168, "nvfp4"),                               # DeepSeek-R1 NVFP4
    (64, 16, 5760, 2880, "mxfp4")])                              # GPT-OSS-120B gate_up, 8 ranks
def test_grouped_kernel_compiles_for_h100_at_expert_shapes(R, E, N, K, method):
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxinfer import gpu_compile
  mesh = gpu_compile.mesh({"data": 1})
  sh = NamedSharding(mesh, P())
  S = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sh)
  block = quant.FIXED_BLOCKS.get(method, (128, 128))
  args = [S((R, K), jnp.bfloat16), S((E, N, quant.stored_in(method, K)), quant.VALUE_DTYPES[method]),
          S((E, N // block[0], K // block[1]), quant.SCALE_DTYPES[method]), S((E,), jnp.int32)]
  kw = dict(block=block, packed=quant.PACKING.get(method))
  if method == "nvfp4":
    args.append(S((E,), jnp.float32))
  fn = lambda x, c, s, g, s2=None: quantized_grouped_matmul(x, c, s, g, scale2=s2, **kw)
  with gpu_compile.lowering(mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  assert "__gpu$xla.gpu.triton" in compiled.as_text()
  mem = gpu_compile.MemoryReport.of(compiled)
  # Scratch is the rows gathered into work items (<= 64 rows of one expert)
  # and their output: no copy of the experts' weights (E * N * K bytes as fp8).
  rows = (-(-R // 64) + E) * 64
  assert mem.temp_bytes <= 1.01 * rows * (K + N) * 2 < E * N * K // 4, mem.temp_bytes
