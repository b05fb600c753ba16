"""Contiguous-cache generation: greedy equals repeated full forwards; sampling behaviour."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams, engine, models, presets


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_greedy_equals_repeated_full_forward(name):
  cfg = presets.get(name)
  params = models.init_params(cfg, jax.random.key(2))
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 7)).astype(np.int32)
  out = engine.generate(cfg, params, prompts, SamplingParams(max_tokens=12))
  np.testing.assert_array_equal(out, engine.greedy_reference(cfg, params, prompts.tolist(), 12))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
  cfg = presets.get("tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  prompts = np.zeros((2, 3), np.int32)
  sp = SamplingParams(max_tokens=20, temperature=1.0, seed=5)
  a, b = engine.generate(cfg, params, prompts, sp), engine.generate(cfg, params, prompts, sp)
  c = engine.generate(cfg, params, prompts, dataclasses.replace(sp, seed=6))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_sample_filters():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512, jnp.float32))
  B = logits.shape[0]
  keys = jax.random.split(jax.random.key(0), B)
  f = lambda t, k, p: np.asarray(engine.sample(
      logits, keys, jnp.full((B,), t, jnp.float32), jnp.full((B,), k, jnp.int32),
      jnp.full((B,), p, jnp.float32)))
  assert set(f(0.0, 0, 1.0)) == {0}  # greedy
  assert set(f(1.0, 2, 1.0)) == {0, 1}  # top-k 2
  assert set(f(1.0, 0, 0.7)) == {0, 1}  # nucleus: 0.5 + 0.3 >= 0.7
  assert set(f(1.0, 0, 0.5)) == {0}
  assert set(f(1.0, 0, 1.0)) == {0, 1, 2, 3}


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
])
def test_impossible_sampling_params(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_generate_rejects_overlong_request():
  cfg = presets.get("tiny_dense", max_position_embeddings=16)
  params = models.init_params(cfg, jax.random.key(0))
  with pytest.raises(ValueError, match="exceeds the context"):
    engine.generate(cfg, params, np.zeros((1, 10), np.int32), SamplingParams(max_tokens=7))
