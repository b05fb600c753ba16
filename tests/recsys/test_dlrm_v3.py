"""DLRMv3's reference model (`recsys.dlrm_v3`) == the independent float64 NumPy
DlrmHSTU (`dlrm_v3_reference`), component by component and whole, on jagged
batches loaded from a reference-layout state dict."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import dlrm_v3_reference as ref
from jaxinfer.backend import Backend
from jaxinfer.recsys import dlrm_batch, dlrm_config, dlrm_state, dlrm_v3, stu, tables
from jaxinfer.recsys.request import DlrmRequest

TOL = dict(rtol=1e-5, atol=1e-5)
BUCKETS = dict(token_bucket=176, user_bucket=10, candidate_bucket=32)
# (history, candidates): one event; max_seq_len (1 + 55 + 8 = 64); no history; no
# candidates (gated: 7 < 20); history 17 < 20 but 17 + 4 >= 20 (the reference gates
# on history + candidates: not gated); gated 12 + 5; 30 + 1; MLPerf's synthetic times.
SHAPES = [(1, 3), (55, 8), (0, 2), (7, 0), (17, 4), (12, 5), (30, 1), (3, 2)]


def reference_state(cfg, seed=0) -> dict:
  """A random DlrmHSTU state dict, written from the torch modules' definitions
  (nn.Linear weight [out, in]), with its three buffers."""
  rng = np.random.default_rng(seed)
  E, D, L = cfg.embedding_dim, cfg.transducer_dim, cfg.num_layers
  NH, U = cfg.num_heads * cfg.attn_linear_dim, cfg.uvqk_dim
  shapes = {ref.EMB + "item_id.weight": (cfg.item_rows, E),
            ref.EMB + "item_category_id.weight": (cfg.category_rows, E),
            ref.EMB + "user_id.weight": (cfg.user_rows, E),
            ref.PRE + "_batched_contextual_linear_weights": (1, E, D),
            ref.PRE + "_batched_contextual_linear_bias": (1, D),
            ref.PRE + "_action_encoder._action_embedding_table": (5, 8),
            ref.PRE + "_action_encoder._target_action_embedding_table": (1, 40),
            ref.POS + "_position_embeddings_weight": (cfg.num_position_buckets, D),
            ref.POS + "_timestamp_embeddings_weight": (cfg.num_time_buckets + 1, D),
            ref.POST + "_time_feature_combiner.weight": (D, D + 4),
            ref.POST + "_time_feature_combiner.bias": (D,),
            ref.POST + "_layer_norm.weight": (D,), ref.POST + "_layer_norm.bias": (D,)}
  mlps = [(ref.PRE + "_content_embedding_mlp.", E, cfg.preprocessor_hidden_dim, D),
          (ref.PRE + "_additional_embedding_mlp.", E, cfg.preprocessor_hidden_dim, D),
          (ref.PRE + "_action_embedding_mlp.", 40, cfg.preprocessor_hidden_dim, D),
          (ref.ITEM, 2 * E, cfg.item_mlp_hidden_dim, D),
          (ref.PRED, D, cfg.prediction_hidden_dim, 1)]
  for prefix, i, h, o in mlps:
    shapes.update({prefix + "0.weight": (h, i), prefix + "0.bias": (h,), prefix + "1.weight": (h,),
                   prefix + "1.bias": (h,), prefix + "2.weight": (o, h), prefix + "2.bias": (o,)})
    if prefix != ref.PRED:
      shapes.update({prefix + "3.weight": (o,), prefix + "3.bias": (o,)})
  for layer in range(L):
    p = f"{ref.STU}{layer}."
    shapes.update({p + "_uvqk_weight": (D, U), p + "_uvqk_beta": (U,),
                   p + "_input_norm_weight": (D,), p + "_input_norm_bias": (D,),
                   p + "_output_weight": (3 * NH, D), p + "_output_norm_weight": (NH,),
                   p + "_output_norm_bias": (NH,)})
  sd = {}
  for k, s in shapes.items():
    if k.startswith(ref.EMB) or k.endswith("_embedding_table"):  # table rows, action rows
      x = (1.0 if k.startswith(ref.EMB) else 0.5) * rng.standard_normal(s)
    elif k.startswith(ref.POS):
      x = 0.3 * rng.standard_normal(s)
    elif len(s) == 1:  # norm weights near 1; biases small but not zero
      one = k.endswith(("1.weight", "3.weight", "_norm_weight", "_layer_norm.weight"))
      x = float(one) + 0.1 * rng.standard_normal(s)
    else:  # fan-in scaled: nn.Linear [out, in]; STU and contextual weights [.., in, out]
      fan_in = s[-2] if (ref.STU in k or len(s) == 3) else s[-1]
      x = rng.standard_normal(s) / np.sqrt(fan_in)
    sd[k] = x.astype(np.float32)
  sd[ref.PRE + "_action_encoder._combined_action_weights"] = np.asarray([1, 2, 4, 8, 16])
  sd[ref.POST + "_period_units"] = np.asarray([[3600.0, 86400.0]], np.float32)
  sd[ref.POST + "_units_per_period"] = np.asarray([[24.0, 7.0]], np.float32)
  return sd


def make_request(cfg, rng, h, c, synthetic=False):
  t0 = 1_700_000_000 + int(rng.integers(0, 10**7))
  times = np.ones(h, np.int64) if synthetic else t0 + np.cumsum(rng.integers(0, 400, h))
  query = 1 if synthetic else int(times[-1] if h else t0) + int(rng.integers(0, 3000))
  return DlrmRequest(user_id=int(rng.integers(0, cfg.user_rows)),
                     item_ids=rng.integers(0, cfg.item_rows, h), ratings=rng.uniform(1, 5.99, h),
                     timestamps=times, category_ids=rng.integers(0, cfg.category_rows, h),
                     candidate_ids=rng.integers(0, cfg.item_rows, c),
                     candidate_category_ids=rng.integers(0, cfg.category_rows, c),
                     query_time=query)


@pytest.fixture(scope="module")
def model():
  cfg = dlrm_config.tiny()
  sd = reference_state(cfg)
  hp = dict(num_heads=cfg.num_heads, linear_dim=cfg.attn_linear_dim, qk_dim=cfg.attn_qk_dim,
            min_uih_length=cfg.contextual_min_uih_length)
  return cfg, sd, hp, dlrm_state.from_reference_state(cfg, sd)


@pytest.fixture(scope="module")
def requests(model):
  cfg = model[0]
  rng = np.random.default_rng(1)
  return [make_request(cfg, rng, h, c, synthetic=(k == len(SHAPES) - 1))
          for k, (h, c) in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def fns(model):
  cfg = model[0]
  p = lambda f: jax.jit(functools.partial(f, cfg))

  def embed(params, batch):
    rows = dlrm_v3.lookup(params["tables"], batch)
    layout = stu.token_layout(batch.offsets, batch.num_candidates, batch.item_ids.shape[0])
    x = dlrm_v3.preprocess(cfg, params, rows, batch, layout)
    return x, dlrm_v3.positional(cfg, params, x, batch, layout)

  def stack(layers, x, batch):
    layout = stu.token_layout(batch.offsets, batch.num_candidates, x.shape[0])
    return stu.stu_stack(cfg, layers, x, layout, batch.n)

  return {"logits": p(dlrm_v3.task_logits), "embed": jax.jit(embed), "stack": jax.jit(stack),
          "post": p(dlrm_v3.postprocess), "item": p(dlrm_v3.item_tower), "head": p(dlrm_v3.head)}


def _per_user(batch, requests):
  """(request, token slice, candidate slice) per real user of a packed batch."""
  cand = np.concatenate([[0], np.cumsum([len(r.candidate_ids) for r in requests])])
  return [(r, slice(batch.offsets[u], batch.offsets[u + 1]), slice(cand[u], cand[u + 1]))
          for u, r in enumerate(requests)]


def test_scores_equal_float64_reference(model, requests, fns):
  cfg, sd, hp, params = model
  batch = dlrm_batch.pack(cfg, requests, **BUCKETS)
  assert max(r.num_tokens for r in requests) == cfg.max_seq_len
  n = ref.batch_n(requests)
  assert batch.n.shape == () and int(batch.n) == n == 64  # an array: traced under jit
  logits = np.asarray(fns["logits"](params, batch))
  for r, _, cs in _per_user(batch, requests):
    np.testing.assert_allclose(logits[cs], ref.user_logits(sd, hp, r, n), **TOL)
  total = sum(len(r.candidate_ids) for r in requests)
  np.testing.assert_allclose(np.asarray(dlrm_v3.predict(cfg, params, batch))[0, :total],
                             1 / (1 + np.exp(-logits[:total, 0])), rtol=1e-5)


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_stu_stack_equals_reference(model, requests, fns, attention):
  # "pallas": the jagged GPU kernel (interpreted here) that `ops.hstu_attention` runs on GPUs.
  cfg, sd, hp, params = model
  batch = dlrm_batch.pack(cfg, requests, **BUCKETS)
  x = np.random.default_rng(2).standard_normal((BUCKETS["token_bucket"], cfg.transducer_dim))
  if attention == "xla":
    out = fns["stack"](params["stu"], jnp.asarray(x, jnp.float32), batch)
  else:
    pc = dataclasses.replace(cfg, backend=Backend(attention="pallas"))
    layout = stu.token_layout(batch.offsets, batch.num_candidates, x.shape[0])
    out = jax.jit(functools.partial(stu.stu_stack, pc))(params["stu"], jnp.asarray(x, jnp.float32),
                                                        layout, batch.n)
  out = np.asarray(out)
  x32 = x.astype(np.float32).astype(np.float64)
  for r, ts, _ in _per_user(batch, requests):
    want = ref.stu_stack_user(sd, hp, x32[ts], len(r.candidate_ids), int(batch.n))
    np.testing.assert_allclose(out[ts], want, **TOL)


def test_preprocessor_and_positional_equal_reference(model, requests, fns):
  cfg, sd, hp, params = model
  batch = dlrm_batch.pack(cfg, requests, **BUCKETS)
  pre, pos = map(np.asarray, fns["embed"](params, batch))
  bias = sd[ref.PRE + "_batched_contextual_linear_bias"][0]
  gated = 0
  for r, ts, _ in _per_user(batch, requests):
    want = ref.preprocess_user(sd, hp, r)
    np.testing.assert_allclose(pre[ts], want, **TOL)
    np.testing.assert_allclose(pos[ts], ref.positional_user(sd, want, r), **TOL)
    is_gated = len(r.item_ids) + len(r.candidate_ids) < cfg.contextual_min_uih_length
    assert np.allclose(pre[ts][0], bias, atol=1e-6) == is_gated  # gated: the bias alone
    gated += is_gated
  assert 0 < gated < len(requests)


def test_postprocessor_item_tower_and_head_equal_reference(model, fns):
  cfg, sd, _, params = model
  rng = np.random.default_rng(3)
  C, D = 16, cfg.transducer_dim
  h = rng.standard_normal((C, D)).astype(np.float32)
  t = np.concatenate([rng.integers(0, 2**31 - 1, C - 2), [0, 1]]).astype(np.int32)
  post = np.asarray(fns["post"](params["postprocessor"], h, t))
  for c in range(C):
    np.testing.assert_allclose(post[c], ref.postprocess(sd, h[c].astype(np.float64), t[c]), **TOL)
  items, cats = rng.integers(0, cfg.item_rows, C), rng.integers(0, cfg.category_rows, C)
  rows = lambda name, ids: params["tables"][name][ids]
  item = np.asarray(fns["item"](params["item_mlp"], rows("item_id", items),
                                rows("item_category_id", cats)))
  logits = np.asarray(fns["head"](params["head"], post, item))
  for c in range(C):
    want_item = ref.item_embedding(sd, items[c], cats[c])
    np.testing.assert_allclose(item[c], want_item, **TOL)
    np.testing.assert_allclose(logits[c], ref.prediction(sd, post[c].astype(np.float64),
                                                         item[c].astype(np.float64)), **TOL)


def test_padding_and_batch_mates_do_not_change_scores(model, requests, fns):
  cfg, sd, hp, params = model
  base = np.asarray(fns["logits"](params, dlrm_batch.pack(cfg, requests, **BUCKETS)))
  bigger = dlrm_batch.pack(cfg, requests, token_bucket=200, user_bucket=13, candidate_bucket=40)
  total = sum(len(r.candidate_ids) for r in requests)
  np.testing.assert_allclose(np.asarray(fns["logits"](params, bigger))[:total], base[:total],
                             rtol=1e-6, atol=1e-6)
  # Same n (the max-length user stays): the others' scores do not depend on who
  # shares the batch; one compiled program serves it.
  subset = [requests[1], requests[4], requests[0]]
  sub = np.asarray(fns["logits"](params, dlrm_batch.pack(cfg, subset, **BUCKETS)))
  c1, c4, c0 = (len(requests[i].candidate_ids) for i in (1, 4, 0))
  starts = np.cumsum([0] + [len(r.candidate_ids) for r in requests])
  np.testing.assert_allclose(sub[c1:c1 + c4], base[starts[4]:starts[5]], rtol=1e-6, atol=1e-6)
  # Without it n drops to 30 + 5 + 1 and the scores follow the reference's 1/n.
  small = [requests[6], requests[5]]
  batch = dlrm_batch.pack(cfg, small, **BUCKETS)
  assert int(batch.n) == ref.batch_n(small) == 36
  got = np.asarray(fns["logits"](params, batch))
  np.testing.assert_allclose(got[:1], ref.user_logits(sd, hp, small[0], 36), **TOL)
  assert not np.allclose(got[:1], ref.user_logits(sd, hp, small[0], 64), **TOL)


def test_reference_state_round_trip(model, requests, fns):
  cfg, sd, _, params = model
  back = dlrm_state.to_reference_state(cfg, params)
  assert set(back) == set(sd)
  for k in sd:
    np.testing.assert_array_equal(np.asarray(back[k], np.float64), np.asarray(sd[k], np.float64),
                                  err_msg=k)
  host = dlrm_state.from_reference_state(cfg, sd, as_numpy=True)
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(params)):
    assert isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
  fresh = dlrm_config.init_params(cfg, jax.random.key(7))
  loaded = dlrm_state.from_reference_state(cfg, dlrm_state.to_reference_state(cfg, fresh))
  assert jax.tree.structure(loaded) == jax.tree.structure(fresh)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(fresh)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  batch = dlrm_batch.pack(cfg, requests, **BUCKETS)
  np.testing.assert_array_equal(np.asarray(fns["logits"](loaded, batch)),
                                np.asarray(fns["logits"](fresh, batch)))


def test_bad_reference_state_names_the_key(model):
  cfg, sd, _, _ = model
  key = ref.STU + "1._output_weight"
  with pytest.raises(ValueError, match=r"missing tensor '_hstu_transducer\._stu_module"
                                       r"\._stu_layers\.1\._output_weight'"):
    dlrm_state.from_reference_state(cfg, {k: v for k, v in sd.items() if k != key})
  w = ref.POST + "_time_feature_combiner.weight"
  with pytest.raises(ValueError, match=rf"{w}.* shape \(36, 32\), expected \(32, 36\)"):
    dlrm_state.from_reference_state(cfg, {**sd, w: sd[w].T})
  extra = {**sd, ref.STU + "2._uvqk_weight": sd[ref.STU + "0._uvqk_weight"]}
  with pytest.raises(ValueError, match=r"unexpected tensors.*_stu_layers\.2\._uvqk_weight"):
    dlrm_state.from_reference_state(cfg, extra)
  b = ref.PRE + "_action_encoder._combined_action_weights"
  with pytest.raises(ValueError, match="_combined_action_weights"):
    dlrm_state.from_reference_state(cfg, {**sd, b: np.asarray([1, 2, 4, 8, 32])})


def test_bad_requests_and_config_name_the_field(model, requests):
  cfg = model[0]
  r = requests[0]
  bad = [(dataclasses.replace(r, item_ids=np.asarray([cfg.item_rows])), r"item_ids.*'item_id'"),
         (dataclasses.replace(r, candidate_category_ids=np.asarray([0, 0, cfg.category_rows])),
          r"candidate_category_ids.*'item_category_id'"),
         (dataclasses.replace(r, user_id=cfg.user_rows), r"user_id.*'user_id'"),
         (dataclasses.replace(r, timestamps=np.asarray([-5])), "timestamps"),
         (make_request(cfg, np.random.default_rng(0), 1, cfg.max_num_candidates + 1),
          "max_num_candidates"),
         (make_request(cfg, np.random.default_rng(0), cfg.max_seq_len - 2, 2), "max_seq_len")]
  for req, pattern in bad:
    with pytest.raises(ValueError, match=r"request 1 \(user_id .*" + pattern):
      dlrm_batch.pack(cfg, [requests[1], req])
  with pytest.raises(ValueError, match="token_bucket"):
    dlrm_batch.pack(cfg, requests, token_bucket=10)
  with pytest.raises(ValueError, match="candidate_bucket"):
    dlrm_batch.pack(cfg, requests, candidate_bucket=3)
  for field, value in [("num_heads", 0), ("action_weights", (1, 1)), ("table_dtype", "int8"),
                       ("max_num_candidates", 64), ("contextual_min_uih_length", -1)]:
    with pytest.raises(ValueError, match=f"DlrmV3Config.{field}"):
      dataclasses.replace(cfg, **{field: value})
  assert hash(cfg) == hash(dlrm_config.tiny())


@pytest.mark.parametrize("row_wise", [("item_id", "item_category_id", "user_id"), ("item_id",)],
                         ids=["row_wise", "mixed"])
def test_sharded_tables_equal_one_device(model, requests, fns, row_wise):
  cfg, _, _, params = model
  batch = dlrm_batch.pack(cfg, requests, **BUCKETS)
  want = np.asarray(fns["logits"](params, batch))
  mesh = Mesh(np.asarray(jax.devices()[:8]), ("data",))
  placed = tables.place_params(params, mesh, "data", row_wise=row_wise)
  assert ("table_wise" in placed["tables"]) == (len(row_wise) < 3)
  np.testing.assert_allclose(np.asarray(fns["logits"](placed, batch)), want, rtol=1e-6, atol=1e-6)


def test_presets_are_abstract_and_hashable():
  big = dlrm_config.dlrm_v3()
  shapes = dlrm_config.abstract_params(big)
  assert shapes["tables"]["item_id"].shape == (1_000_000_000, 512)
  assert shapes["tables"]["item_id"].dtype == jnp.float16
  assert shapes["stu"]["uvqk_w"].shape == (5, 512, 4 * (2 * 128 + 2 * 128))
  assert shapes["stu"]["out_w"].shape == (5, 3 * 4 * 128, 512)
  assert len(dlrm_state.REFERENCE_NAMES) == len(jax.tree.leaves(shapes))
  assert hash(big) != hash(dlrm_config.tiny())
