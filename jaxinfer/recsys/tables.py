"""Embedding tables: lookups, bag pooling, row quantization, and sharded tables.

A table is one of these types, and `lookup` follows the type (no mode flag):
  jax.Array [R, D]       a float table: rows gathered
  QuantTable             int8 / float8_e4m3fn rows [R, D] with a float32 scale
                         per row [R]: row r = values[r] * scales[r]
  RowSharded             a table's rows split over a mesh axis (contiguous
                         blocks); a lookup is two all-to-all exchanges
  TableWise              a group of tables, whole tables split over a mesh axis
                         (`lookup_many` looks the whole group up at once)

Sharded lookups run in `shard_map` (`sharding_lookup.py`'s exchanges) and
return exactly the rows a single-device gather returns: every row travels
whole, nothing is summed. `lookup_many(tables, ids_by_name)` looks up a dict
of tables (or a `TableWise` group) by name; `pooled` sums bags of rows into
one row per bag (the `EmbeddingBag` sum of torchrec's `EmbeddingBagCollection`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

QUANT_DTYPES = {"int8": (jnp.int8, 127.0),
                "float8_e4m3fn": (jnp.float8_e4m3fn, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max))}


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
    return table.values[ids].astype(jnp.float32) * table.scales[ids][:, None]
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


def lookup(table, ids):
  """Rows of one table at ids [n] -> [n, D] float32, by the table's type."""
  return gather_rows(table, ids)


def lookup_many(tables, ids_by_name: dict) -> dict:
  """{name: ids [n]} -> {name: rows [n, D] float32} from a dict of tables."""
  return {name: lookup(tables[name], ids) for name, ids in ids_by_name.items()}
