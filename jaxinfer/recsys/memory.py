"""Memory plans for DLRMv3 on GPUs, compiled from abstract params.

`plan(cfg, devices=64)` builds the abstract param tree of cfg's model
(`family.of(cfg)`: DLRMv3 as MLPerf runs it, or the paper-era HSTU; nothing
allocates), places it as `tables.place_params` would (the big tables row-wise
over every device, the rest table-wise; dense params replicated), lowers the
model's `score` for a mesh of compile-only H100s (`jaxinfer.gpu_compile`)
with the Pallas kernel as the attention, compiles it and reads the per-device
bytes off `memory_analysis()`. A plan says whether it fits the GPU's memory
and, if not, by how much it is over; `quant` sizes int8 / fp8 tables (one
byte a value plus a float32 scale a row).

The `dlrm_v3` preset's fp16 tables (item_id 1B x 512, user_id 10M x 512,
item_category_id 128 x 512, as MLPerf's `configs.py` declares them) are
~1.03 TB: 16 GB a device on 64 H100s, 129 GB on 8 (over the 80 GB), where
int8 or fp8 rows (~0.52 TB, 65 GB a device) fit with room for the step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer import gpu_compile
from jaxinfer.backend import Backend
from jaxinfer.recsys import family, tables as tables_lib

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes of one compiled scoring step on `devices` GPUs."""
  devices: int
  gpu: str
  quant: str | None
  table_bytes: int  # all tables, whole model
  memory: gpu_compile.MemoryReport  # per device
  hbm_bytes: float

  @property
  def fits(self) -> bool:
    return self.memory.peak_bytes <= self.hbm_bytes

  def summary(self) -> str:
    m = self.memory
    share = self.table_bytes / self.devices
    verdict = ("fits" if self.fits else
               f"DOES NOT FIT: {m.peak_bytes / GB:.1f} GB > {self.hbm_bytes / GB:.0f} GB "
               f"({(m.peak_bytes - self.hbm_bytes) / GB:.1f} GB over); the embedding tables "
               f"alone are {share / GB:.1f} GB a device")
    return (f"{self.devices} x {self.gpu}, tables {self.quant or 'unquantized'} "
            f"({self.table_bytes / 1e12:.3f} TB in all): per device arguments "
            f"{m.argument_bytes / GB:.2f} GB, temporaries {m.temp_bytes / GB:.2f} GB, "
            f"peak {m.peak_bytes / GB:.2f} GB of {self.hbm_bytes / GB:.0f} GB: {verdict}")


def _abstract_table(sds, quant: str | None):
  if quant is None:
    return sds
  qdtype, _ = tables_lib.QUANT_DTYPES[quant]
  return tables_lib.QuantTable(jax.ShapeDtypeStruct(sds.shape, qdtype),
                               jax.ShapeDtypeStruct(sds.shape[:1], jnp.float32))


def _place(x, mesh, spec):
  put = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree.map(put, x)


def abstract_placed_params(cfg, mesh, axis: str, *, row_wise, quant=None) -> dict:
  """`tables.place_params` of abstract params: the same types, ShapeDtypeStruct leaves."""
  ap = family.of(cfg).abstract_params(cfg)
  d = mesh.shape[axis]
  tabs = {k: _abstract_table(v, quant) for k, v in ap["tables"].items()}
  placed = {}
  for k in row_wise:
    rows = tabs[k].shape[0]
    padded = -(-rows // d) * d
    grow = lambda s: jax.ShapeDtypeStruct((padded, *s.shape[1:]), s.dtype)
    placed[k] = tables_lib.RowSharded(_place(jax.tree.map(grow, tabs[k]), mesh, P(axis)), rows,
                                      mesh, axis)
  rest = [k for k in tabs if k not in row_wise]
  if rest:
    rmax, k_pad = max(tabs[k].shape[0] for k in rest), -(-len(rest) // d) * d
    stack = lambda s: jax.ShapeDtypeStruct((k_pad, rmax, *s.shape[1:]), s.dtype)
    placed["table_wise"] = tables_lib.TableWise(
        _place(jax.tree.map(stack, tabs[rest[0]]), mesh, P(axis)), tuple(rest),
        tuple(tabs[k].shape[0] for k in rest), mesh, axis)
  dense = _place({k: v for k, v in ap.items() if k != "tables"}, mesh, P())
  return {**dense, "tables": placed}


def abstract_batch(cfg, mesh, *, tokens: int, users: int, targets: int,
                   feature_ids: int = 512):
  """The model's batch (`family.of(cfg)`) of ShapeDtypeStructs at the step's buckets, replicated."""
  return family.of(cfg).abstract_batch(cfg, NamedSharding(mesh, P()), tokens=tokens, users=users,
                                       candidates=targets, feature_ids=feature_ids)


def table_bytes(cfg, quant: str | None = None) -> int:
  """Bytes of every table (unpadded): rows x dim x itemsize (+ a float32 scale a row)."""
  rows, width = sum(cfg.table_rows().values()), family.of(cfg).table_width(cfg)
  if quant is None:
    return rows * width * jnp.dtype(cfg.table_dtype).itemsize
  return rows * (width * jnp.dtype(tables_lib.QUANT_DTYPES[quant][0]).itemsize + 4)


def plan(cfg, *, devices: int, gpu: str = "h100", quant: str | None = None,
         row_wise=None, tokens: int = 8192, users: int = 64, targets: int = 2048,
         feature_ids: int = 512) -> Plan:
  """Compile one scoring step for `devices` GPUs (8 a host) -> its `Plan`.
  row_wise: tables split by rows (default: every table over 1M rows)."""
  if devices < 1 or (devices > 8 and devices % 8):
    raise ValueError(f"devices must be 1..8 or a multiple of 8 (hosts of 8), got {devices}")
  if row_wise is None:
    row_wise = tuple(k for k, r in cfg.table_rows().items() if r >= 1_000_000)
  mesh = gpu_compile.mesh({"data": devices}, gpu=gpu, hosts=max(1, devices // 8))
  gcfg = dataclasses.replace(cfg, backend=Backend(target="gpu"))
  params = abstract_placed_params(gcfg, mesh, "data", row_wise=row_wise, quant=quant)
  batch = abstract_batch(gcfg, mesh, tokens=tokens, users=users, targets=targets,
                         feature_ids=feature_ids)
  with gpu_compile.lowering(mesh):
    score = family.of(cfg).score
    compiled = jax.jit(lambda p, b: score(gcfg, p, b)).lower(params, batch).compile()
  return Plan(devices=devices, gpu=gpu, quant=quant, table_bytes=table_bytes(cfg, quant),
              memory=gpu_compile.MemoryReport.of(compiled),
              hbm_bytes=gpu_compile.target(gpu).hbm_bytes)


def per_device_table_bytes(cfg, devices: int, quant: str | None = None) -> float:
  """The tables' share of one device when every table is split evenly (a lower bound)."""
  return table_bytes(cfg, quant) / devices if devices else math.inf
