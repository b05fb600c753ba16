"""HSTU over packed jagged tokens == the independent float64 NumPy reference."""

import dataclasses

import jax
import numpy as np
import pytest

import hstu_reference as ref
from jaxinfer.backend import Backend
from jaxinfer.recsys import batch as batch_lib, config, hstu
from jaxinfer.recsys.batch import User


def random_user(cfg, rng, n_hist, n_cand, t0=1_000_000):
  gaps = rng.integers(0, 5000, n_hist)
  times = (t0 + np.cumsum(gaps)).tolist()
  feats = [rng.integers(0, r, rng.integers(0, 4)).tolist() for r in cfg.user_feature_rows]
  return User(items=rng.integers(0, cfg.num_items, n_hist).tolist(),
              actions=rng.integers(1, cfg.num_actions, n_hist).tolist(), timestamps=times,
              features=feats, candidates=rng.integers(0, cfg.num_items, n_cand).tolist(),
              query_time=(times[-1] if times else t0) + int(rng.integers(1, 10**6)))


@pytest.fixture(scope="module")
def model():
  cfg = config.tiny()
  return cfg, config.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def score_fn(model):
  cfg, _ = model
  return jax.jit(lambda p, b: hstu.score(cfg, p, b))


def _users(cfg, seed=0):
  rng = np.random.default_rng(seed)
  # (history, candidates): a user with one event, one at max_seq_len (1 + 55 + 8 = 64),
  # one with no history, and two ordinary ones.
  shapes = [(1, 3), (cfg.max_seq_len - 9, 8), (0, 2), (7, 1), (20, 4)]
  return [random_user(cfg, rng, h, c) for h, c in shapes]


def _pack(cfg, users):
  # One set of buckets: every batch of these tests runs the same compiled program.
  return batch_lib.pack(cfg, users, token_bucket=128, user_bucket=8, target_bucket=24,
                        feature_bucket=16)


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def test_forward_equals_float64_reference_on_jagged_batch(model, score_fn):
  cfg, params = model
  users = _users(cfg)
  assert max(u.num_tokens for u in users) == cfg.max_seq_len
  assert min(len(u.items) for u in users if u.items) == 1
  # Buckets add padding tokens, an empty padding user and unused candidate slots.
  b = batch_lib.pack(cfg, users, token_bucket=128, user_bucket=8, target_bucket=24,
                     feature_bucket=16)
  logits = np.asarray(score_fn(params, b))
  want = np.concatenate([ref.score_user(cfg, params, u) for u in users])
  got = logits[:len(want)]
  assert np.all(np.isfinite(logits))
  err = _rel(got, want)
  print(f"HSTU float32 vs float64 reference: max rel err {err:.2e}")
  assert err <= 1e-5


def test_scores_do_not_depend_on_batch_mates_or_other_candidates(model, score_fn):
  cfg, params = model
  users = _users(cfg, seed=1)
  together = np.asarray(score_fn(params, _pack(cfg, users)))
  u = users[3]
  alone = np.asarray(score_fn(params, _pack(cfg, [u])))
  start = sum(len(x.candidates) for x in users[:3])
  np.testing.assert_allclose(alone[:1], together[start:start + 1], rtol=1e-6, atol=1e-6)
  # The 8-candidate user: each candidate scored alone gives its score among all 8.
  big = users[1]
  all8 = np.asarray(score_fn(params, _pack(cfg, [big])))[:8]
  for c in (0, 5):
    one = dataclasses.replace(big, candidates=[big.candidates[c]])
    np.testing.assert_allclose(
        np.asarray(score_fn(params, _pack(cfg, [one])))[0], all8[c],
        rtol=1e-6, atol=1e-6)


def test_history_matters_and_is_causal(model):
  cfg, params = model
  u = _users(cfg)[4]
  b = batch_lib.pack(cfg, [u])
  fwd = jax.jit(lambda p, b: hstu.forward(cfg, p, b))
  h = np.asarray(fwd(params, b))
  changed = dataclasses.replace(u, items=[*u.items[:-1], (u.items[-1] + 1) % cfg.num_items])
  h2 = np.asarray(fwd(params, batch_lib.pack(cfg, [changed])))
  last_hist = len(u.items)  # token index of the last history event (ctx token first)
  np.testing.assert_array_equal(h[:last_hist], h2[:last_hist])  # earlier tokens: causal
  assert np.max(np.abs(h[last_hist:] - h2[last_hist:])) > 1e-4  # it and the candidates see it


def _bad_batches(cfg):
  b = batch_lib.pack(cfg, _users(cfg)[:2])
  items = b.item_ids.copy()
  items[3] = cfg.num_items
  offs = b.offsets.copy()
  offs[1] = offs[2] + 1
  feats = b.feature_ids[0].copy()
  feats[:1] = -1
  long_user = [random_user(cfg, np.random.default_rng(0), cfg.max_seq_len, 1)]
  return [
      (dataclasses.replace(b, item_ids=items), "item_ids out of table range"),
      (dataclasses.replace(b, offsets=offs), "offsets must start at 0 and be non-decreasing"),
      (dataclasses.replace(b, timestamps=b.timestamps.astype(np.float32)),
       "timestamps must be an integer array"),
      (dataclasses.replace(b, feature_ids=(feats, *b.feature_ids[1:]) if len(feats) else None),
       "feature_ids\\[0\\] out of table range"),
      (dataclasses.replace(b, num_targets=b.num_targets + 100), "num_targets must be"),
      (long_user, "over max_seq_len"),
  ]


def test_bad_input_raises_value_error_naming_it(model):
  cfg, _ = model
  for bad, match in _bad_batches(cfg):
    with pytest.raises(ValueError, match=match):
      if isinstance(bad, list):
        batch_lib.pack(cfg, bad)
      else:
        batch_lib.validate(cfg, bad)


def test_pallas_kernel_path_equals_xla_path(model, score_fn):
  # The model on the jagged Pallas kernel (interpret mode on CPU) == its XLA form.
  cfg, params = model
  b = batch_lib.pack(cfg, _users(cfg, seed=3), token_bucket=128)
  kcfg = dataclasses.replace(cfg, backend=Backend(attention="pallas"))
  got = np.asarray(jax.jit(lambda p, b: hstu.score(kcfg, p, b))(params, b))
  want = np.asarray(score_fn(params, b))
  assert _rel(got, want) <= 1e-5


def test_config_rejects_bad_fields_and_presets_have_the_benchmarks_dims():
  with pytest.raises(ValueError, match="user_feature_rows"):
    config.HSTUConfig(num_items=10, user_feature_rows=())
  with pytest.raises(ValueError, match="num_heads"):
    config.HSTUConfig(num_items=10, num_heads=0)
  with pytest.raises(ValueError, match="unknown recsys preset"):
    config.get("dlrm_v2")
  big = config.get("hstu_paper")
  assert (big.num_layers, big.num_heads, big.embed_dim, big.num_items) == (5, 4, 512, 10**9)
  assert config.get("tiny_hstu", num_layers=1).num_layers == 1


def test_bad_user_input_raises_naming_the_user_field_and_table(model):
  cfg, _ = model  # tiny: items 1000, actions 8, user_0 16 rows, user_1 24 rows
  u = random_user(cfg, np.random.default_rng(3), 5, 2)
  rep = lambda **kw: [u, dataclasses.replace(u, **kw)]
  cases = [
      (rep(features=[*u.features, [0]]), r"user 1: features has 3 bags, the model has 2 "),
      (rep(features=u.features[:1]), r"user 1: features has 1 bags, .*user_0..user_1"),
      (rep(items=[*u.items[:-1], cfg.num_items]), r"user 1: items .*table 'items'.*max 1000"),
      (rep(candidates=[-1, 0]), r"user 1: candidates .*table 'items'.*min -1"),
      (rep(actions=[*u.actions[:-1], cfg.num_actions]), r"user 1: actions .*table 'actions'"),
      (rep(features=[[16], u.features[1]]), r"user 1: features\[0\] .*'user_0'.*\[0, 16\)"),
      (rep(features=[u.features[0], [0, 24]]), r"user 1: features\[1\] .*'user_1'.*\[0, 24\)"),
      (rep(features=[[0.5], u.features[1]]), r"user 1: features\[0\] must be a flat list of int"),
  ]
  for users, match in cases:
    with pytest.raises(ValueError, match=match):
      batch_lib.pack(cfg, users)
  batch_lib.pack(cfg, rep(features=[[], []]))  # empty bags are fine: one per table
  with pytest.raises(ValueError, match=r"candidates: 4 in this batch, over the candidate limit"):
    batch_lib.pack(cfg, [u, u], target_bucket=3)
