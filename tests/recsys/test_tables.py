"""Embedding tables: row-wise and table-wise sharding over 8 CPU devices give the
single-device rows and scores exactly; int8 / fp8 rows; bag pooling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_hstu import _users
from jaxinfer import sharding
from jaxinfer.recsys import batch as batch_lib, config, hstu, tables


@pytest.fixture(scope="module")
def setup():
  cfg = config.tiny()
  params = config.init_params(cfg, jax.random.key(1))
  b = batch_lib.pack(cfg, _users(cfg, seed=2), token_bucket=128, feature_bucket=16)
  return cfg, params, b


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 8
  return sharding.make_mesh({"data": 8})


@functools.cache
def _jitted_score(cfg):
  return jax.jit(functools.partial(hstu.score, cfg))  # one cache of programs per config


def _score(cfg, params, b):
  return np.asarray(_jitted_score(cfg)(params, b))


# Mixed (items row-wise, the rest table-wise) runs in the int8 and hot-row tests.
@pytest.mark.parametrize("row_wise", [("items", "actions", "user_0", "user_1"), ()],
                         ids=["row_wise", "table_wise"])
def test_sharded_tables_give_single_device_scores_exactly(setup, mesh, row_wise):
  cfg, params, b = setup
  want = _score(cfg, params, b)
  placed = tables.place_params(params, mesh, "data", row_wise=row_wise)
  if row_wise:
    assert isinstance(placed["tables"]["items"], tables.RowSharded)
    shard = placed["tables"]["items"].table.addressable_shards[0].data
    assert shard.shape[0] == -(-cfg.num_items // 8)  # rows really split
  if len(row_wise) < 4:
    assert isinstance(placed["tables"]["table_wise"], tables.TableWise)
  got = _score(cfg, placed, b)
  np.testing.assert_array_equal(got, want)


def test_rowwise_lookup_exchanges_rows_exactly_with_odd_counts(mesh):
  rng = np.random.default_rng(0)
  t = jnp.asarray(rng.standard_normal((37, 8)), jnp.float32)  # 37 rows: padded to 40
  ids = jnp.asarray(rng.integers(0, 37, 13), jnp.int32)  # 13 ids: padded to 16
  ids = ids.at[:4].set(36)  # several ids for the last device's last row
  for table in (t, tables.quantize_rows(t, "int8")):
    sharded = tables.shard_rowwise(table, mesh, "data")
    got = jax.jit(tables.lookup)(sharded, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(tables.gather_rows(table, ids)))


def test_sharded_lookups_are_all_to_all_exchanges(mesh):
  t = tables.shard_rowwise(jnp.ones((64, 4)), mesh, "data")
  text = jax.jit(tables.lookup).lower(t, jnp.zeros((16,), jnp.int32)).as_text()
  assert text.count("all_to_all") == 2  # ids out, rows back
  g = tables.shard_tablewise({"a": jnp.ones((8, 4)), "b": jnp.ones((5, 4))}, mesh, "data")
  ids = {"a": jnp.zeros((16,), jnp.int32), "b": jnp.zeros((3,), jnp.int32)}
  text = jax.jit(lambda g, ids: tables.lookup_many({"g": g}, ids)).lower(g, ids).as_text()
  assert text.count("all_to_all") == 2


@pytest.mark.parametrize("dtype,tol", [("int8", 0.5 / 127), ("float8_e4m3fn", 2.0 ** -4)])
def test_row_quantization_error_is_bounded_per_row(dtype, tol):
  rng = np.random.default_rng(3)
  t = rng.standard_normal((50, 16)).astype(np.float32) * rng.uniform(0.01, 10, (50, 1))
  t[7] = 0.0  # an all-zero row
  q = tables.quantize_rows(t, dtype)
  assert q.values.dtype == jnp.dtype(dtype) and q.scales.shape == (50,)
  err = np.abs(np.asarray(tables.dequantize(q)) - t)
  amax = np.abs(t).max(1)
  assert np.all(err.max(1) <= tol * amax + 1e-12)
  assert np.all(np.asarray(tables.dequantize(q))[7] == 0)


def test_int8_tables_score_close_and_shard_exactly(setup, mesh):
  cfg, params, b = setup
  want = _score(cfg, params, b)
  q = tables.quantize_tables(params, "int8")
  got = _score(cfg, q, b)
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  print(f"int8 tables vs float32: max rel err {err:.2e}")
  assert 0 < err < 2e-2
  placed = tables.place_params(q, mesh, "data", row_wise=("items",))
  np.testing.assert_array_equal(_score(cfg, placed, b), got)


def test_pooled_is_the_sum_over_each_bag():
  rows = jnp.arange(12.0).reshape(6, 2)
  out = tables.pooled(rows, jnp.asarray([0, 2, 2, 5]), 3)  # bags {0,1}, {}, {2,3,4}; row 5 pads
  np.testing.assert_array_equal(np.asarray(out), [[2, 4], [0, 0], [18, 21]])


def test_pooled_lookup_equals_torch_embedding_bag():
  """The pooled sparse features against torch's `EmbeddingBag(mode="sum")`
  with offsets, the computation torchrec's `EmbeddingBagCollection` runs
  per table on CPU (torchrec itself: its fbgemm-gpu-cpu 1.9 does not load
  against the pinned torch, docs/recsys.md). Empty bags and repeated ids."""
  import torch  # noqa: PLC0415 (the dev extra's CPU torch, only here)
  rng = np.random.default_rng(0)
  table = rng.normal(size=(50, 8)).astype(np.float32)
  lengths = [3, 0, 1, 7, 0, 2]
  ids = rng.integers(0, 50, sum(lengths))
  ids[1] = ids[0]
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  ours = tables.pooled(tables.gather_rows(jnp.asarray(table), jnp.asarray(ids)),
                       jnp.asarray(offsets), len(lengths))
  bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(table), mode="sum")
  ref = bag(torch.from_numpy(ids), torch.from_numpy(offsets[:-1])).numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-6, atol=1e-6)


def test_bad_arguments_raise_value_error():
  with pytest.raises(ValueError, match="dtype must be one of"):
    tables.quantize_rows(jnp.ones((4, 4)), "int4")
  with pytest.raises(ValueError, match="table must be a float"):
    tables.quantize_rows(jnp.ones((4, 4), jnp.int32))
  with pytest.raises(ValueError, match="ids out of table range"):
    tables.check_ids("items", np.array([0, 9]), 9)
  with pytest.raises(ValueError, match="ids must be integers"):
    tables.check_ids("items", np.array([0.0]), 9)
  with pytest.raises(ValueError, match="row_wise names tables that do not exist"):
    tables.shard_tables({"a": jnp.ones((8, 2))}, sharding.make_mesh({"data": 8}), "data",
                        row_wise=("b",))
  with pytest.raises(ValueError, match="no table 'zz'"):
    tables.lookup_many({"a": jnp.ones((8, 2))}, {"zz": jnp.zeros((1,), jnp.int32)})


def test_hot_rows_are_served_locally_exactly_and_even_the_load(setup, mesh):
  cfg, params, b = setup
  rng = np.random.default_rng(5)
  rows = 256
  trace = (rng.zipf(1.3, 4000) - 1) % rows  # skewed: rows 0.. on device 0 are hot
  hot = tables.plan_hot_rows(trace, 8)
  assert list(hot) == sorted(hot) and 0 in hot
  before = tables.exchange_load(trace, rows, 8)
  after = tables.exchange_load(trace, rows, 8, hot)
  print(f"row-wise exchange imbalance {tables.imbalance(before):.2f} -> "
        f"{tables.imbalance(after):.2f} with 8 hot rows; ids exchanged {before.sum()} -> "
        f"{after.sum()}")
  assert tables.imbalance(after) < tables.imbalance(before) and after.sum() < before.sum()
  t = jnp.asarray(rng.standard_normal((rows, 8)), jnp.float32)
  ids = jnp.asarray(trace[:64], jnp.int32)
  for table in (t, tables.quantize_rows(t, "int8")):
    sharded = tables.replicate_hot_rows(tables.shard_rowwise(table, mesh, "data"), table, hot)
    got = jax.jit(tables.lookup)(sharded, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(tables.gather_rows(table, ids)))
  # Hot ids never reach the exchange: NaN in the sharded copies of hot rows stays unseen.
  poisoned = tables.shard_rowwise(t.at[hot].set(jnp.nan), mesh, "data")
  got = jax.jit(tables.lookup)(tables.replicate_hot_rows(poisoned, t, hot), ids)
  assert np.isin(trace[:64], hot).any()
  np.testing.assert_array_equal(np.asarray(got), np.asarray(t[ids]))
  # The whole model, its item table row-wise with hot rows: the same scores, exactly.
  placed = tables.place_params(params, mesh, "data", row_wise=("items",))
  items = placed["tables"]["items"]
  hot_items = tables.plan_hot_rows(np.asarray(b.item_ids), 16)
  placed["tables"]["items"] = tables.replicate_hot_rows(items, params["tables"]["items"],
                                                        hot_items)
  np.testing.assert_array_equal(_score(cfg, placed, b), _score(cfg, params, b))
  with pytest.raises(ValueError, match="sorted and distinct"):
    tables.replicate_hot_rows(items, params["tables"]["items"], hot_items[::-1])
