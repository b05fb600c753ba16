"""bfloat16 on a CPU target: the matmuls multiply bf16 x bf16 into float32
(no converted copy of the weights), and the Engine keeps its KV pool in
float32 there (a bf16 scatter made XLA:CPU convert the whole pool every
step); GPU targets keep bf16 pools. A bf16 engine's greedy tokens are the
bf16 full forward's best within rounding."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import Backend, Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.engine import engine as engine_mod
from jaxinfer.models import transformer
from jaxinfer.models.layers import linear, pack_linear


def test_bf16_linear_multiplies_into_float32_without_converting_the_weight():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((5, 64)), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal((64, 48)), jnp.bfloat16)
  y = jax.jit(linear)(x, w)
  assert y.dtype == jnp.bfloat16
  want = (x.astype(jnp.float32) @ w.astype(jnp.float32)).astype(jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2, atol=1e-2)
  hlo = jax.jit(linear).lower(x, w).compile().as_text()
  assert "f32[64,48]" not in hlo  # no float32 copy of the weight


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_lone_row_is_padded_to_two(packed):
  """One bf16 row (XLA:CPU's slow case) multiplies as two rows, the first
  kept: same numbers as the float32 product within bf16 rounding."""
  r = np.random.default_rng(1)
  x = jnp.asarray(r.standard_normal((1, 1, 64)), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal((64, 48)), jnp.bfloat16)
  weight = pack_linear(w, out_major=True) if packed else w
  y = jax.jit(linear)(x, weight)
  assert y.shape == (1, 1, 48) and y.dtype == jnp.bfloat16
  want = x.astype(jnp.float32) @ w.astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=2e-2, atol=5e-2)
  hlo = jax.jit(linear).lower(x, weight).compile().as_text()
  assert re.search(r"f32\[(2,48|48,2)\][^\n]*dot\(", hlo), "the dot does not multiply two rows"


def test_cpu_pool_is_float32_and_gpu_pool_keeps_bf16():
  cfg = dataclasses.replace(presets.get("tiny_dense"), dtype="bfloat16")
  assert engine_mod._pool_dtype(cfg) == jnp.float32
  gpu = dataclasses.replace(cfg, backend=Backend(target="gpu"))
  assert engine_mod._pool_dtype(gpu) == jnp.bfloat16
  f32 = dataclasses.replace(cfg, dtype="float32")
  assert engine_mod._pool_dtype(f32) == jnp.float32
  for kernel in ("pallas", "mosaic"):  # interpreted kernels read pages in q's dtype
    interpreted = dataclasses.replace(cfg, backend=Backend(attention=kernel))
    assert engine_mod._pool_dtype(interpreted) == jnp.bfloat16


def test_bf16_engine_picks_the_bf16_references_argmax_within_rounding():
  """The bf16 engine (float32 pool) against bf16 full forwards of its own
  output: every generated token's reference logit is within bf16 rounding
  of the reference's best (exact equality of greedy tokens does not hold:
  the pool's float32 attention differs from the reference's bf16 one)."""
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=2), dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0))
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, max_num_seqs=4))
  assert eng.stats()["kv_cache_dtype"] == "float32"
  prompts = [np.random.default_rng(1).integers(0, cfg.vocab_size, n).tolist() for n in (9, 21)]
  outs = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=6))]
  for prompt, out in zip(prompts, outs):
    seq = jnp.asarray([prompt + out], jnp.int32)
    logits = np.asarray(transformer.logits(cfg, params, seq)[0].astype(jnp.float32))
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(out)]  # the rows that chose `out`
    chosen = rows[np.arange(len(out)), out]
    assert np.all(chosen >= rows.max(-1) - 0.02 * np.abs(rows).max()), (chosen, rows.max(-1))
