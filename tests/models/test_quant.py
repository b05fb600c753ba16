"""Quantized weights (`models.quant`): each format's dequantization equals a
numpy reference written from the formats' formulas (quant_formats.md), edge
blocks included; quantized params run every model path and shard."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxinfer
from jaxinfer import models
from jaxinfer.config import QuantConfig
from jaxinfer.models import quant
from quant_reference import reference

CASES = [("fp8", (128, 128), (576, 320)),  # DeepSeek kv_a_proj rows: partial edge blocks
         ("fp8", (1, 0), (48, 64)), ("fp8", (0, 0), (40, 24)), ("int8", (1, 0), (40, 64)),
         ("int4", (1, 32), (24, 80)), ("mxfp4", (1, 32), (3, 24, 64)), ("nvfp4", (1, 16), (2, 40, 48))]


@pytest.mark.parametrize("method,block,shape", CASES)
def test_dequantization_matches_numpy_reference(method, block, shape):
  w = np.random.default_rng(0).normal(0, 0.05, shape).astype(np.float32)
  values, scale, scale2 = quant.quantize_matrix(w, method, block)
  qw = quant.QuantizedWeight(values=jnp.asarray(values), scale=jnp.asarray(scale),
                             scale2=None if scale2 is None else jnp.asarray(scale2), method=method,
                             block=quant.FIXED_BLOCKS.get(method, block),
                             in_shape=(shape[-1],), out_shape=(shape[-2],))
  got = np.asarray(jax.jit(lambda q: quant.matmul_weight(q, jnp.float32))(qw))
  want = reference(values, scale, scale2, method, block)
  if method == "nvfp4":  # s * s2 * code: two float32 roundings, in either order
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
  else:
    np.testing.assert_array_equal(got, want)
  # And the quantization itself is close: per-block absmax keeps the relative error
  # of the largest entries within the format's precision.
  tol = {"fp8": 0.07, "int8": 0.01, "int4": 0.15, "mxfp4": 0.3, "nvfp4": 0.2}[method]
  assert np.max(np.abs(got - w)) <= tol * np.max(np.abs(w))


def test_storage_dtypes_and_bytes():
  w = np.random.default_rng(1).normal(size=(64, 128)).astype(np.float32)
  for method, per_weight in [("fp8", 1), ("int8", 1), ("int4", .5), ("mxfp4", .5), ("nvfp4", .5)]:
    v, s, s2 = quant.quantize_matrix(w, method, (1, 32))
    assert v.nbytes == w.size * per_weight
    assert v.dtype == np.dtype(quant.VALUE_DTYPES[method])
    assert s.dtype == np.dtype(quant.SCALE_DTYPES[method])
  v, s, _ = quant.quantize_matrix(w, "fp8", (128, 128))
  assert v.dtype == ml_dtypes.float8_e4m3fn and s.shape == (1, 1)


def test_dense_restores_our_orientation():
  rng = np.random.default_rng(2)
  w = rng.normal(size=(3, 4, 8, 16)).astype(np.float32)  # [E, In=(4, 8), Out=16]... in_dims 2
  qw = quant.quantize(w, "int8", (1, 0), in_dims=2, lead=1)
  assert qw.shape == w.shape and qw.values.shape == (3, 16, 32)
  np.testing.assert_allclose(np.asarray(quant.dense(jax.tree.map(jnp.asarray, qw))), w,
                             atol=0.01 * np.abs(w).max())


def _tiny(method, block, moe_impl="grouped"):
  cfg = dataclasses.replace(jaxinfer.presets.get("tiny_moe"), moe_impl=moe_impl)
  qcfg = dataclasses.replace(cfg, quant=QuantConfig(method=method, block=block))
  p = models.init_params(cfg, jax.random.key(0))
  return cfg, p, qcfg, models.specs.quantize_params(qcfg, p)


def _dequantized(qcfg, qp):
  """The quantized params with every weight dequantized: the float model they encode."""
  return dataclasses.replace(qcfg, quant=None), quant.dense_tree(qp, jnp.float32)


@pytest.mark.parametrize("method,block,moe_impl", [("fp8", (16, 16), "grouped"),
                                                   ("nvfp4", (1, 16), "dense"),
                                                   ("int4", (1, 32), "grouped")])
def test_quantized_forward_equals_dequantized_float_forward(method, block, moe_impl):
  _, _, qcfg, qp = _tiny(method, block, moe_impl)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, qcfg.vocab_size, (2, 9)))
  fcfg, fp = _dequantized(qcfg, qp)
  np.testing.assert_allclose(models.logits(qcfg, qp, tokens), models.logits(fcfg, fp, tokens),
                             rtol=1e-5, atol=1e-5)
  # Kept quantized: the storage dtype, and 1 byte per weight or less.
  leaf = qp["layers"][1]["mlp"]["w_gate"]
  assert isinstance(leaf, quant.QuantizedWeight)
  assert leaf.values.dtype == quant.VALUE_DTYPES[method]
  assert quant.nbytes(qp) < 0.35 * quant.nbytes(fp)


def test_quantized_params_under_expert_parallel_mesh():
  from jaxinfer import sharding
  _, _, qcfg, qp = _tiny("fp8", (16, 16))
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  sp = sharding.shard_params(qcfg, qp, mesh, layout="dp_attn_ep")
  w = sp["layers"][1]["mlp"]["w_gate"]
  # Scales follow their blocks: split over the expert axes like the values.
  assert w.values.sharding.spec[1] is not None
  assert w.scale.sharding.spec[1] == w.values.sharding.spec[1]
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, qcfg.vocab_size, (2, 7)))
  assert models.moe_ep.plan_from_params(sp) is not None  # the MoE layers run expert-parallel
  got = models.logits(qcfg, sp, tokens)
  np.testing.assert_allclose(got, models.logits(qcfg, qp, tokens), rtol=2e-5, atol=2e-5)


def test_engine_greedy_on_quantized_params_equals_full_forward_greedy():
  # The unrolled layout (the CPU engine's for big models) keeps quantized weights
  # unfused; the scanned one runs them as `models.logits` does.
  _, _, qcfg, qp = _tiny("int8", (1, 0))
  engine = jaxinfer.Engine(qcfg, qp, jaxinfer.EngineConfig(max_num_seqs=2, page_size=8, num_pages=32,
                                                           unroll_layers=True))
  prompts = [[3, 17, 5, 9], [8, 1, 2]]
  outs = engine.generate(prompts, jaxinfer.SamplingParams(max_tokens=6, temperature=0.0))
  for prompt, out in zip(prompts, outs):
    seq = list(prompt)
    for _ in range(6):
      seq.append(int(jnp.argmax(models.logits(qcfg, qp, jnp.asarray([seq]))[0, -1])))
    assert out.token_ids == seq[len(prompt):]


def test_quant_config_errors():
  with pytest.raises(ValueError, match="method"):
    QuantConfig(method="fp6")
  with pytest.raises(ValueError, match="targets"):
    QuantConfig(method="fp8", targets=("attn.wx",))
  with pytest.raises(ValueError, match="odd"):
    quant.quantize_matrix(np.ones((4, 5), np.float32), "int4")
