"""tokamax (openxla's Pallas kernel library) as `Backend` choices:
`dense_attention="tokamax"` (`tokamax.dot_product_attention`) and
`grouped_matmul="tokamax"` (`tokamax.ragged_dot`).

tokamax needs Python >= 3.12 and jax >= 0.11.1, so these tests are
`newest_jax` (CI's Python 3.12 job runs them; test-core installs tokamax
there). On a CPU tokamax runs its XLA kernels, which checks our argument
mapping (GQA, scale, causality, HF's window as (left, right) keys, per-row
lengths, padding rows, ragged groups) against the float32 references; its
Mosaic GPU kernels need a GPU device even to lower (their sm90 check reads
the device), so they stay candidates until a GPU run matches them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_library_attention import _qkv
import jaxinfer
from jaxinfer import Backend, library_attention, models, ops, presets, xla_attention
import pallas_kernels

pytestmark = pytest.mark.newest_jax


@pytest.fixture(name="tokamax")
def _tokamax():
  """The Backend of both tokamax choices (built in the test: on a jax line
  without tokamax the module is collected, then deselected, and building it
  would raise)."""
  return Backend(dense_attention="tokamax", grouped_matmul="tokamax")


@pytest.mark.parametrize("window", [0, 5])
def test_causal_and_full_attention_equal_the_reference(window, tokamax):
  q, k, v = _qkv(jax.random.key(0), 2, 24, 8, 2, 32)
  got = ops.causal_attention(q, k, v, window=window, scale=0.3, backend=tokamax)
  want = pallas_kernels.flash_attention_reference(q, k, v, causal=True, sm_scale=0.3,
                                                  window=window)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  q, k, v = _qkv(jax.random.key(1), 2, 12, 4, 4, 16, S=20)
  got = ops.full_attention(q, k, v, scale=0.25, backend=tokamax)
  want = pallas_kernels.flash_attention_reference(q, k, v, causal=False, sm_scale=0.25)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_fresh_chunks_equal_the_packed_xla_form_with_padding_rows_zero():
  # tokamax leaves padded query rows non-zero: fresh_packed must zero them.
  T, N, K, H = 16, 4, 2, 8
  q, k, v = (jax.random.normal(kk, (T, n, H))
             for kk, n in zip(jax.random.split(jax.random.key(2), 3), (N, K, K)))
  cu = jnp.asarray([0, 5, 12, 13, 13], jnp.int32)
  got = library_attention.fresh_packed(q, k, v, cu, 8, scale=0.4, impl="tokamax", window=3)
  want = xla_attention.packed_step(q, k, v, cu, 3, None, 0.4)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(got[13:]))


def test_grouped_matmul_equals_ragged_dot_and_zeroes_rows_past_the_groups(tokamax):
  kx, kw = jax.random.split(jax.random.key(3))
  xs = jax.random.normal(kx, (70, 32))
  w = jax.random.normal(kw, (4, 32, 16))
  sizes = jnp.asarray([10, 20, 4, 30], jnp.int32)  # 64 rows: 6 past the groups
  got = ops.grouped_matmul(xs, w, sizes, backend=tokamax)
  np.testing.assert_allclose(got, jax.lax.ragged_dot(xs, w, sizes), atol=1e-5, rtol=1e-5)
  assert not np.any(np.asarray(got[64:]))


def test_a_moe_model_and_the_engine_on_tokamax_equal_their_defaults(tokamax):
  """tiny_moe's full forward with tokamax's experts, and the Engine's greedy
  tokens (tiny_dense: its fresh prompt steps on tokamax's attention)."""
  cfg = dataclasses.replace(presets.get("tiny_moe"), dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
  want = models.logits(cfg, params, tokens)
  got = models.logits(dataclasses.replace(cfg, backend=tokamax), params, tokens)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 33))]

  def greedy(c):
    eng = jaxinfer.Engine(c, params, jaxinfer.EngineConfig(
        max_num_seqs=4, num_pages=64, page_size=8, max_num_batched_tokens=64,
        unroll_layers=True))
    return [o.token_ids for o in eng.generate(
        prompts, jaxinfer.SamplingParams(max_tokens=6, temperature=0.0))]

  assert greedy(dataclasses.replace(cfg, backend=tokamax)) == greedy(cfg)
