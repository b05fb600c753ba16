"""Embedding tables: lookups, bag pooling, row quantization, and sharded tables.

A table is one of these types, and `lookup` follows the type (no mode flag):
  jax.Array [R, D]       a float table: rows gathered
  QuantTable             int8 / float8_e4m3fn rows [R, D] with a float32 scale
                         per row [R]: row r = values[r] * scales[r]
  RowSharded             a table's rows split over a mesh axis (contiguous
                         blocks); a lookup is two all-to-all exchanges; the
                         hottest rows may be replicated on every device
                         (`plan_hot_rows`, `replicate_hot_rows`: EPLB-style),
                         their lookups local
  TableWise              a group of tables, whole tables split over a mesh axis
                         (`lookup_many` looks the whole group up at once)

Sharded lookups run in `shard_map` (all-to-all exchanges over the axis) and
return exactly the rows a single-device gather returns: every row travels
whole, nothing is summed; the model after them runs replicated.
`lookup_many(tables, ids_by_name)` looks up a dict of tables (or a
`TableWise` group) by name; `pooled` sums bags of rows into one row per bag
(the `EmbeddingBag` sum of torchrec's `EmbeddingBagCollection`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
QUANT_DTYPES = {"int8": (jnp.int8, 127.0), "float8_e4m3fn": (jnp.float8_e4m3fn, _FP8_MAX)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantTable:
  """Rows quantized with one float32 scale each: row r ~= values[r] * scales[r]."""
  values: jax.Array  # [R, D] int8 | float8_e4m3fn
  scales: jax.Array  # [R] float32

  @property
  def shape(self):
    return self.values.shape


def quantize_rows(table, dtype: str = "int8") -> QuantTable:
  """A float table [R, D] -> `QuantTable` with per-row absmax scales
  (scale = max|row| / qmax; an all-zero row gets scale 1)."""
  if dtype not in QUANT_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(QUANT_DTYPES)}, got {dtype!r}")
  table = jnp.asarray(table)
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(f"table must be a float [R, D] array, got {table.dtype} {table.shape}")
  qdtype, qmax = QUANT_DTYPES[dtype]
  t = table.astype(jnp.float32)
  amax = jnp.max(jnp.abs(t), axis=1)
  scales = jnp.where(amax > 0, amax / qmax, 1.0)
  q = t / scales[:, None]
  q = jnp.clip(jnp.round(q), -qmax, qmax) if dtype == "int8" else q
  return QuantTable(values=q.astype(qdtype), scales=scales)


def dequantize(t: QuantTable):
  return t.values.astype(jnp.float32) * t.scales[:, None]


def gather_rows(table, ids):
  """Rows of an unsharded table (float or `QuantTable`) at ids [n] -> [n, D] float32.
  Ids must be in range (checked on the host by `batch.validate`); under jit an
  out-of-range id is clipped, as jnp indexing does."""
  if isinstance(table, QuantTable):
    return table.values[ids].astype(jnp.float32) * table.scales[ids][..., None]
  return table[ids].astype(jnp.float32)


def pooled(rows, bag_offsets, num_bags: int):
  """Sum-pooled bags: rows [n, D] with bag b = rows[offsets[b]:offsets[b + 1]] -> [B, D].
  Rows past offsets[-1] (padding) belong to no bag."""
  n = rows.shape[0]
  bag = jnp.searchsorted(bag_offsets, jnp.arange(n), side="right") - 1  # num_bags for padding
  return jax.ops.segment_sum(rows, bag, num_segments=num_bags + 1)[:num_bags]


def check_ids(name: str, ids, rows: int) -> None:
  """Host check: integer ids in [0, rows), else ValueError naming the table."""
  ids = np.asarray(ids)
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name}: ids must be integers, got dtype {ids.dtype}")
  if ids.size and (ids.min() < 0 or ids.max() >= rows):
    raise ValueError(f"{name}: ids out of table range [0, {rows}): min {ids.min()}, "
                     f"max {ids.max()}")


# ------------------------------------------------------------------ sharded tables

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("table", "hot_ids", "hot_rows"),
                   meta_fields=("rows", "mesh", "axis"))
@dataclasses.dataclass(frozen=True)
class RowSharded:
  """One table's rows in contiguous blocks over mesh axis `axis` (rows padded
  to a multiple of its size): device d holds rows [d R', (d + 1) R').
  With hot rows (`replicate_hot_rows`), copies of the hottest rows sit on
  every device and their ids never cross the exchange."""
  table: object  # [R', D] float, or a QuantTable of [R', D] values and [R'] scales
  rows: int
  mesh: Mesh
  axis: str
  hot_ids: object = None  # [H] int32, sorted: the replicated rows' ids
  hot_rows: object = None  # [H, D] (or a QuantTable): those rows, replicated


@functools.partial(jax.tree_util.register_dataclass, data_fields=("tables",),
                   meta_fields=("names", "rows", "mesh", "axis"))
@dataclasses.dataclass(frozen=True)
class TableWise:
  """Whole tables over mesh axis `axis`: `names` stacked [K', Rmax, D] (K'
  padded to a multiple of the axis size, rows to the largest table), table k
  on device k // (K' / axis size)."""
  tables: object  # [K', Rmax, D] float, or a QuantTable of [K', Rmax, D] / [K', Rmax]
  names: tuple[str, ...]
  rows: tuple[int, ...]
  mesh: Mesh
  axis: str


def _pad_to(x, n: int, axis: int = 0):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, widths)


def _map_table(fn, table):
  return QuantTable(fn(table.values), fn(table.scales)) if isinstance(table, QuantTable) else fn(
      table)


def shard_rowwise(table, mesh: Mesh, axis: str) -> RowSharded:
  """A table (float or `QuantTable`) -> `RowSharded` over `axis`, placed on the mesh."""
  n = mesh.shape[axis]
  rows = table.shape[0]
  padded = -(-rows // n) * n
  put = lambda x: jax.device_put(_pad_to(x, padded), NamedSharding(mesh, P(axis)))
  return RowSharded(_map_table(put, table), rows, mesh, axis)


def shard_tablewise(tables: dict, mesh: Mesh, axis: str) -> TableWise:
  """Same-width tables {name: [R, D]} (all float or all `QuantTable`) -> one `TableWise`."""
  names = tuple(tables)
  rows = tuple(int(tables[k].shape[0]) for k in names)
  k_pad = -(-len(names) // mesh.shape[axis]) * mesh.shape[axis]
  rmax = max(rows)
  stack = lambda xs: _pad_to(jnp.stack([_pad_to(x, rmax) for x in xs]), k_pad)
  if all(isinstance(tables[k], QuantTable) for k in names):
    stacked = QuantTable(stack([tables[k].values for k in names]),
                         stack([tables[k].scales for k in names]))
  else:
    stacked = stack([tables[k] for k in names])
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(axis)))
  return TableWise(_map_table(put, stacked), names, rows, mesh, axis)


def _rowwise_lookup(t: RowSharded, ids):
  """Two all-to-alls: ids to their rows' owners, rows back (capacity = the
  sender's ids per owner, so nothing is dropped). ids [n] -> [n, D] float32."""
  d = t.mesh.shape[t.axis]
  n = ids.shape[0]
  m = -(-n // d)
  per = t.table.shape[0] // d  # rows per device
  a2a = lambda x: lax.all_to_all(x, t.axis, 0, 0, tiled=True)

  def local(tab, my_ids, hot_ids, hot_rows):  # tab [per, D] (this device's rows), my_ids [m]
    me = lax.axis_index(t.axis)
    owner = my_ids // per
    hot, slot = _hot_slots(hot_ids, my_ids)
    ask = (owner[None, :] == jnp.arange(d)[:, None]) & ~hot[None, :]
    recv = a2a(jnp.where(ask, my_ids[None, :], -1))  # [d, m]: ids asked of my rows (-1: none)
    got = gather_rows(tab, jnp.clip(recv - me * per, 0, per - 1))  # [d, m, D]
    back = a2a(jnp.where((recv >= 0)[..., None], got, 0.0))  # [d, m, D]: row from owner d
    rows = jnp.take_along_axis(back, owner[None, :, None], axis=0)[0]
    if hot_rows is None:
      return rows
    return jnp.where(hot[:, None], gather_rows(hot_rows, slot), rows)

  out = jax.shard_map(local, mesh=t.mesh, in_specs=(P(t.axis), P(t.axis), P(), P()),
                      out_specs=P(t.axis))(t.table, _pad_to(ids, m * d), t.hot_ids, t.hot_rows)
  return _replicated(out[:n], t.mesh)


def _hot_slots(hot_ids, ids):
  """-> (is hot [n] bool, slot [n] int32 in hot_ids) for ids [n]."""
  if hot_ids is None:
    return jnp.zeros(ids.shape, bool), jnp.zeros(ids.shape, jnp.int32)
  slot = jnp.clip(jnp.searchsorted(hot_ids, ids), 0, hot_ids.shape[0] - 1).astype(jnp.int32)
  return hot_ids[slot] == ids, slot


def _tablewise_lookup(t: TableWise, ids_by_name: dict) -> dict:
  """DLRM's table-wise exchange: batch-split ids to the tables' owners
  (all-to-all), local gathers, rows back to the batch owners (all-to-all)."""
  d = t.mesh.shape[t.axis]
  k_pad = t.tables.shape[0]
  n = max(ids.shape[0] for ids in ids_by_name.values())
  n_pad = -(-n // d) * d
  ids = jnp.zeros((k_pad, n_pad), jnp.int32)
  for name, x in ids_by_name.items():
    ids = ids.at[t.names.index(name), :x.shape[0]].set(x.astype(jnp.int32))

  def local(tabs, my_ids):  # tabs [K'/d, Rmax, D], my_ids [K', n/d] (my batch slice)
    mine = lax.all_to_all(my_ids, t.axis, 0, 1, tiled=True)  # [K'/d, n]: my tables, all ids
    rows = jax.vmap(gather_rows)(tabs, mine)  # [K'/d, n, D]
    return lax.all_to_all(rows, t.axis, 1, 0, tiled=True)  # [K', n/d, D]

  out = jax.shard_map(local, mesh=t.mesh, in_specs=(P(t.axis), P(None, t.axis)),
                      out_specs=P(None, t.axis))(t.tables, ids)
  out = _replicated(out, t.mesh)
  return {name: out[t.names.index(name), :x.shape[0]] for name, x in ids_by_name.items()}


def _replicated(x, mesh: Mesh):
  # The model after the lookup runs replicated: the same program as on one device.
  return lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def lookup(table, ids):
  """Rows of one table at ids [n] -> [n, D] float32, by the table's type."""
  if isinstance(table, RowSharded):
    return _rowwise_lookup(table, ids)
  return gather_rows(table, ids)


def lookup_many(tables: dict, ids_by_name: dict) -> dict:
  """{name: ids [n]} -> {name: rows [n, D] float32}. `tables` maps names to
  tables (any type of the module docstring); a `TableWise` entry (under any
  key) serves the names it holds, looked up together."""
  out, groups = {}, [t for t in tables.values() if isinstance(t, TableWise)]
  for g in groups:
    mine = {k: v for k, v in ids_by_name.items() if k in g.names and k not in tables}
    if mine:
      out.update(_tablewise_lookup(g, mine))
  for name, ids in ids_by_name.items():
    if name in out:
      continue
    if name not in tables:
      raise ValueError(f"no table {name!r}; tables: {sorted(tables)}")
    out[name] = lookup(tables[name], ids)
  return out


def shard_tables(tables: dict, mesh: Mesh, axis: str, *, row_wise=()) -> dict:
  """{name: table} -> the names in `row_wise` as `RowSharded`, the rest as one
  `TableWise` group under the key "table_wise" (row-wise for the few huge
  tables, table-wise for the many small ones: DLRM's usual plan)."""
  unknown = set(row_wise) - set(tables)
  if unknown:
    raise ValueError(f"row_wise names tables that do not exist: {sorted(unknown)}")
  if axis not in mesh.shape:
    raise ValueError(f"mesh has no axis {axis!r}; axes: {tuple(mesh.shape)}")
  out = {k: shard_rowwise(tables[k], mesh, axis) for k in row_wise}
  rest = {k: v for k, v in tables.items() if k not in row_wise}
  if rest:
    out["table_wise"] = shard_tablewise(rest, mesh, axis)
  return out


def quantize_tables(params: dict, dtype: str = "int8") -> dict:
  """Model params with every table as a `QuantTable` (`quantize_rows`)."""
  return {**params, "tables": {k: quantize_rows(v, dtype) for k, v in params["tables"].items()}}


def place_params(params: dict, mesh: Mesh, axis: str, *, row_wise=()) -> dict:
  """Model params on `mesh`: tables by `shard_tables`, the rest replicated."""
  rest = {k: v for k, v in params.items() if k != "tables"}
  rest = jax.device_put(rest, NamedSharding(mesh, P()))
  return {**rest, "tables": shard_tables(params["tables"], mesh, axis, row_wise=row_wise)}


# ------------------------------------------------------------------ hot rows (EPLB-style)

def plan_hot_rows(ids_trace, num_hot: int) -> np.ndarray:
  """The `num_hot` most looked-up ids of a trace, sorted (int32): the rows to
  replicate, as EPLB replicates the hottest experts."""
  ids, counts = np.unique(np.asarray(ids_trace).ravel(), return_counts=True)
  if num_hot < 1:
    raise ValueError(f"num_hot must be >= 1, got {num_hot}")
  top = ids[np.argsort(-counts, kind="stable")[:num_hot]]
  return np.sort(top).astype(np.int32)


def replicate_hot_rows(sharded: RowSharded, table, hot_ids) -> RowSharded:
  """`sharded` (of the unsharded `table`) with copies of rows `hot_ids` on every device."""
  hot_ids = np.asarray(hot_ids)
  check_ids("hot_ids", hot_ids, sharded.rows)
  if np.any(np.diff(hot_ids) <= 0):
    raise ValueError("hot_ids must be sorted and distinct (plan_hot_rows makes them)")
  idx = jnp.asarray(hot_ids, jnp.int32)
  rows = _map_table(lambda x: x[idx], table)
  put = lambda x: jax.device_put(x, NamedSharding(sharded.mesh, P()))
  return dataclasses.replace(sharded, hot_ids=put(idx), hot_rows=_map_table(put, rows))


def exchange_load(ids, rows: int, devices: int, hot_ids=None) -> np.ndarray:
  """Ids each device's rows serve in a row-wise lookup of `ids` ([devices] counts;
  hot ids are served locally and not counted)."""
  ids = np.asarray(ids).ravel()
  if hot_ids is not None:
    ids = ids[~np.isin(ids, np.asarray(hot_ids))]
  per = -(-rows // devices)
  return np.bincount(ids // per, minlength=devices)


def imbalance(load) -> float:
  """(max - mean) / mean of per-device load (0: even), EPLB's measure."""
  load = np.asarray(load, np.float64)
  return float((load.max() - load.mean()) / max(load.mean(), 1e-12))
