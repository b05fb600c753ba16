"""Contiguous-cache generation: greedy equals repeated full forwards; sampling behaviour."""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import Engine, EngineConfig, SamplingParams, engine, models, presets
from jaxinfer.engine import sampling


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_equals_jnp_argmax_on_ties_nans_and_infinities(dtype):
  nan, inf = float("nan"), float("inf")
  rows = np.array([[1.0, 3.0, 3.0, 2.0],  # a tie: the first
                   [-inf, -inf, -inf, -inf],  # nothing above -inf: 0
                   [0.0, -0.0, 0.0, -1.0],  # signed zeros compare equal
                   [1.0, nan, 5.0, nan],  # a NaN is the largest: the first NaN
                   [inf, 2.0, inf, nan],
                   [-2.0, -1.0, -3.0, -1.0]], np.float32)
  rng = np.random.default_rng(0)
  noise = rng.standard_normal((3, 5, 1000)).astype(np.float32).round(1)  # many ties
  for x in (rows, noise):
    x = jnp.asarray(x, dtype)
    got = jax.jit(sampling.argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))


def test_top_k_fast_path_equals_the_full_sort():
  # lax.top_k over k_cap logits gives the same filtered logits, hence the
  # same samples, as sorting the vocabulary; rows mix top_k, top_p and T.
  B, V = 64, 5000
  logits = jax.random.normal(jax.random.key(1), (B, V)) * 3.0
  rng = np.random.default_rng(0)
  temperature = jnp.asarray(rng.uniform(0.3, 2.0, B), jnp.float32)
  top_k = jnp.asarray(rng.integers(1, 65, B), jnp.int32)
  top_p = jnp.asarray(rng.choice([1.0, 0.9, 0.5, 0.05], B), jnp.float32)
  full = sampling.filter_logits(logits, temperature, top_k, top_p)
  for k_cap in (64, 128):
    np.testing.assert_array_equal(
        sampling.filter_logits(logits, temperature, top_k, top_p, k_cap=k_cap), full)
  keys = jax.random.split(jax.random.key(2), B)
  np.testing.assert_array_equal(
      engine.sample(logits, keys, temperature, top_k, top_p, k_cap=64),
      engine.sample(logits, keys, temperature, top_k, top_p))
  # The bucket: powers of two from 16, greedy rows ignored, 0 where any
  # sampled row has no top_k or one over 1024.
  P = SamplingParams
  assert sampling.top_k_cap([P(temperature=1.0, top_k=40), P(top_k=0)]) == 64
  assert sampling.top_k_cap([P(temperature=1.0, top_k=3)]) == 16
  assert sampling.top_k_cap([P(temperature=1.0, top_k=1024)]) == 1024
  assert sampling.top_k_cap([P(temperature=1.0, top_k=1025)]) == 0
  assert sampling.top_k_cap([P(temperature=1.0, top_k=40), P(temperature=0.5)]) == 0
  assert sampling.top_k_cap([P()]) == 0


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_top_k_sampling_takes_the_fast_path_with_the_same_tokens(speculative):
  # A top_k batch runs the k_cap program (plain, or MTP speculation: target
  # and draft distributions both filtered so); its tokens equal filtering by
  # the full sort (the same engine with the fast path off).
  from jaxinfer import MTPConfig
  cfg = presets.get("tiny_moe" if speculative else "tiny_dense")
  params = models.init_params(cfg, jax.random.key(0))
  config = EngineConfig(num_pages=32, speculative=MTPConfig(num_draft_tokens=2, batch_schedule=())
                        if speculative else None)
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
  sp = [SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=s) for s in (1, 2)]
  fast = Engine(cfg, params, config)
  out = fast.generate(prompts, sp)
  # The program key's last field is k_cap: 32 on every step.
  assert {key[-1] for key in fast._runner.counts.programs} == {32}
  with mock.patch.object(sampling, "top_k_cap", return_value=0):
    slow = Engine(cfg, params, config)
    ref = slow.generate(prompts, sp)
  assert {key[-1] for key in slow._runner.counts.programs} == {0}
  assert [o.token_ids for o in out] == [r.token_ids for r in ref]
  if speculative:
    assert fast.stats()["spec_verify_steps"] > 0


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
