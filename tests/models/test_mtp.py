"""MTP modules: the training form equals the cached form, depths chain through
the right module, and a few training steps lower the MTP loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import models, presets, training
from jaxinfer.kv.contexts import ContiguousContext, FullContext
from jaxinfer.models import mtp
from jaxinfer.models.layers import rope_cos_sin
from jaxinfer.models.transformer import trunk


def _cfg(**kw):
  return dataclasses.replace(presets.get("tiny_moe"), dtype="float32", num_layers=2, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(num_mtp_layers=2, dense_layers=(0, 2))],
                         ids=["one-moe-module", "two-modules-dense"])
def test_train_form_equals_cached_form(kw):
  cfg = _cfg(**kw)
  params = models.init_params(cfg, jax.random.key(0))
  B, T = 2, 12
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, T)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  hidden, _ = trunk(cfg, params, tokens, FullContext(pos, (0,)))
  full = mtp.train_logits(cfg, params, hidden, tokens, depths=2)  # [2, B, T, V]
  assert full.shape == (2, B, T, 256)

  # The same two depths over a contiguous cache, in two chunks of 5 and 7.
  entry = cfg.cache_entry_shapes()
  M = cfg.num_mtp_layers
  cache = {k: jnp.zeros((M, B, T, *e)) for k, e in entry.items()}
  caches = [cache, cache]  # depth 1 and depth 2 keep separate histories here
  got = [[], []]
  for lo, hi in ((0, 5), (5, T)):
    ctx = ContiguousContext(jnp.full((B,), lo, jnp.int32))
    cos, sin = rope_cos_sin(cfg, ctx.token_positions(hi - lo))
    h = hidden[:, lo:hi]
    for k in (1, 2):
      nxt = jnp.pad(tokens, ((0, 0), (0, k)))[:, lo + k:hi + k]
      m = mtp.module_for(cfg, k)
      h, caches[k - 1] = mtp.apply(cfg, params, m, h, nxt, cos, sin, ctx, caches[k - 1])
      got[k - 1].append(mtp.logits(cfg, params, m, h))
  for k in (0, 1):
    chunked = jnp.concatenate(got[k], axis=1)
    np.testing.assert_allclose(chunked, full[k], atol=2e-4, rtol=1e-4)
  # Depth 2 really runs its own module when there are two.
  assert mtp.module_for(cfg, 2) == (1 if M == 2 else 0)
  assert mtp.module_for(cfg, 5) == M - 1


def test_mtp_block_follows_dense_layers():
  assert mtp.is_moe(_cfg())
  dense = _cfg(dense_layers=(0, 2))
  assert not mtp.is_moe(dense)
  assert "router" not in models.param_specs(dense)["mtp"]["block"]["mlp"]
  with pytest.raises(ValueError, match="dense_layers"):
    _cfg(dense_layers=(0, 3))  # past the one MTP module
  with pytest.raises(ValueError, match="no MTP modules"):
    mtp.module_for(_cfg(num_mtp_layers=0), 1)


def test_loss_masks_and_training_lowers_it():
  cfg = _cfg()
  params = models.init_params(cfg, jax.random.key(1))
  data = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, np.uint8)
  batch = next(training.batches(data, 4, 32, seed=0))
  loss, m = training.loss_fn(cfg, params, jnp.asarray(batch), depths=3, mtp_weight=0.5)
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss), float(m["loss_main"]) + 0.5 * np.mean(
      [float(m[f"loss_mtp{k}"]) for k in (1, 2, 3)]), rtol=1e-5)
  opt = training.make_optimizer(3e-3, 20, 2)
  state = opt.init(params)
  first = None
  for _ in range(20):
    params, state, m = training.train_step(cfg, opt, params, state, jnp.asarray(batch),
                                           depths=3, mtp_weight=0.5)
    first = first or {k: float(v) for k, v in m.items()}
  for k in ("loss_main", "loss_mtp1", "loss_mtp3"):
    assert float(m[k]) < 0.5 * first[k], (k, first[k], float(m[k]))


def test_corpus_split_is_fixed_and_disjoint():
  files = training.corpus_files()
  held = [f for f in files if training.is_held_out(f)]
  assert 0 < len(held) < 0.15 * len(files)
  assert all(training.is_held_out(f) for f in held)  # deterministic
  assert not any("/test/" in f or f.startswith("test/") for f in files)
