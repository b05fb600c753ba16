"""Quantized and packed projections on XLA:CPU (`models.quant_cpu`,
`layers.row_reduce_matmul`): the code decoders are exact for every code, the
CPU step layout's unpacked codes hold the same numbers and pack back, the
multiply-reduce equals dequantize-then-dot, `linear` picks it where it is
meant to, and an Engine on quantized weights decodes what the full forward
does."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxinfer
from jaxinfer import models
from jaxinfer.config import QuantConfig
from jaxinfer.models import layers, quant, quant_cpu

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
CASES = [("int8", (1, 0)), ("fp8", (1, 0)), ("fp8", (128, 128)), ("int8", (0, 0)),
         ("int4", (1, 0)), ("int4", (1, 32)), ("mxfp4", (1, 32)), ("nvfp4", (1, 16))]


def test_decoders_are_exact_for_every_code():
  codes = np.arange(256, dtype=np.uint8)
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(jax.jit(quant_cpu.fp8_e4m3_to_f32)(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))))
  np.testing.assert_array_equal(got, want)  # NaN codes included
  assert np.array_equal(np.signbit(got), np.signbit(want))
  nib = jnp.arange(16, dtype=jnp.int32)
  np.testing.assert_array_equal(np.asarray(quant_cpu.e2m1_to_f32(nib)), E2M1)
  np.testing.assert_array_equal(np.asarray(quant_cpu.int4_to_f32(nib)),
                                np.where(np.arange(16) >= 8, np.arange(16) - 16, np.arange(16)))


def _weight(method, block, shape=(256, 200), seed=0):
  w = np.random.default_rng(seed).normal(0, 0.05, shape).astype(np.float32)
  return jax.device_put(quant.quantize(w, method, block))


@pytest.mark.parametrize("method,block", CASES)
def test_unpacked_codes_hold_the_same_numbers_and_pack_back(method, block):
  q = _weight(method, block, (192, 256))
  u = layers.pack_linear(q)  # the CPU step layout's form
  held = {"fp8": jnp.bfloat16, "int8": jnp.int8}.get(method, jnp.int8)
  assert u.values.dtype == held and u.values.shape == (256, 192)
  np.testing.assert_array_equal(np.asarray(quant.dense(u)), np.asarray(quant.dense(q)))
  back = layers.unpack_linear(u)
  assert back.values.dtype == q.values.dtype and back.values.shape == q.values.shape
  same = np.asarray(back.values) == np.asarray(q.values)
  if method in ("mxfp4", "nvfp4"):  # a -0 code (nibble 8) may come back as +0
    v = np.asarray(q.values)
    minus_zero = ((v & 0xF) == 8) | ((v >> 4) == 8)
    assert np.all(same | minus_zero)
  else:
    assert np.all(same)


@pytest.mark.parametrize("method,block", CASES)
@pytest.mark.parametrize("rows", [1, 3])
def test_reduce_matmul_equals_dequantize_then_dot(method, block, rows):
  q = _weight(method, block)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(rows, 256)).astype(np.float32))
  want = np.asarray(x @ quant.dense(q, jnp.float32))
  for w in (q, layers.pack_linear(q)):  # as loaded and as the step holds it
    got = np.asarray(jax.jit(quant_cpu.reduce_matmul)(x, w))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
  assert quant_cpu.reducible(q) == (block[1] in (0, 128))


def test_reduce_matmul_refuses_blocks_that_do_not_tile_in():
  q = _weight("fp8", (128, 128), (192, 64))
  assert not quant_cpu.reducible(q)
  with pytest.raises(ValueError, match="blocks of 128 over 192"):
    quant_cpu.reduce_matmul(jnp.ones((2, 192)), q)


def test_float_row_reduce_equals_the_dot():
  w = np.random.default_rng(0).normal(size=(96, 160)).astype(np.float32)
  p = layers.pack_linear(jnp.asarray(w))
  for rows in (1, 5):
    x = np.random.default_rng(rows).normal(size=(rows, 96)).astype(np.float32)
    got = np.asarray(layers.row_reduce_matmul(jnp.asarray(x), p))
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)


def _has_dot(fn, *args) -> bool:
  return "dot_general" in str(jax.make_jaxpr(fn)(*args))


def test_linear_takes_the_reduce_for_few_rows_on_cpu_and_the_dot_otherwise():
  w = layers.pack_linear(jnp.asarray(np.ones((64, 48), np.float32)))
  q = layers.pack_linear(_weight("int8", (1, 0), (64, 48)))
  lin = lambda x, w, target=None: layers.linear(x, w, backend=jaxinfer.Backend(target=target))
  lo_f, hi_f = layers.ROW_REDUCE_ROWS["float"]
  lo_q, hi_q = layers.ROW_REDUCE_ROWS["quantized"]
  x = lambda n: jnp.ones((n, 64), jnp.float32)
  assert not _has_dot(lin, x(lo_f), w) and not _has_dot(lin, x(hi_f), w)
  assert _has_dot(lin, x(hi_f + 1), w)
  assert _has_dot(lin, x(lo_f - 1), w) == (lo_f > 1)
  assert not _has_dot(lin, x(lo_q), q) and _has_dot(lin, x(hi_q + 1), q)
  # A GPU target always gets the dot (or the quantized kernel).
  assert _has_dot(lambda x, w: lin(x, w, target="gpu"), x(4), w)
  # Rows across leading dims: [2, 3, D] is 6 rows, same values as the dot.
  x3 = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 64)).astype(np.float32))
  np.testing.assert_allclose(np.asarray(lin(x3, w)), np.asarray(x3 @ jnp.ones((64, 48))),
                             rtol=1e-5)


def _tiny(method, block):
  cfg = jaxinfer.presets.get("tiny_moe")
  qcfg = dataclasses.replace(cfg, quant=QuantConfig(method=method, block=block))
  return qcfg, models.specs.quantize_params(qcfg, models.init_params(cfg, jax.random.key(0)))


@pytest.mark.parametrize("method,block", [("fp8", (1, 0)), ("mxfp4", (1, 32))])
def test_unrolled_engine_on_quantized_weights_decodes_the_full_forward_greedy(method, block):
  qcfg, qp = _tiny(method, block)
  engine = jaxinfer.Engine(qcfg, qp, jaxinfer.EngineConfig(max_num_seqs=2, page_size=8,
                                                           num_pages=32, unroll_layers=True))
  held = engine._model.params["layers"][0][0]["attn"]["wq_a" if qcfg.q_lora_rank else "wq"]
  assert held.values.dtype == (jnp.bfloat16 if method == "fp8" else jnp.int8)
  prompts = [[3, 17, 5, 9], [8, 1, 2]]
  outs = engine.generate(prompts, jaxinfer.SamplingParams(max_tokens=6, temperature=0.0))
  assert [o.token_ids for o in outs] == jaxinfer.engine.greedy_reference(qcfg, qp, prompts, 6)
  # Engine.params gives the loaded format back, the same numbers.
  for a, b in zip(jax.tree.leaves(quant.dense_tree(engine.params, jnp.float32)),
                  jax.tree.leaves(quant.dense_tree(qp, jnp.float32))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert {l.dtype for l in jax.tree.leaves(engine.params)} == {l.dtype for l in jax.tree.leaves(qp)}
