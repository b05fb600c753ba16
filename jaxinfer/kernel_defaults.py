"""Hopper defaults by measurement: the kernel winner table a GPU run wrote
(`kernel_bench` or the GPU day: `experiments/benchlib/kernel_winners.py`),
committed in this package as kernel_tables/kernel_winners_<device>_<date>.json.

`Backend`'s None choices for library kernels on a Hopper target read the
newest committed table (by the date in it): `dense_attention` from its
"flash" rows, `grouped_matmul` from its "gmm" rows. A candidate can become
a default only where that GPU run matched its float32 reference: one that
ran and mismatched in any case is out, and one that never matched is out.
Among the rest the default is the fastest over the table's cases, counting
our kernel's time for a case the candidate did not run (the dispatch runs
ours there too). With no table committed, or none naming a Hopper, the
built-in defaults hold (`Backend`).

  CHOICES        per Backend field: the table's kernel and candidate -> value
  choose         a table's default for a field (None: the built-in one)
  latest         the newest committed table (None: none), read once
  hopper_default `choose(latest(), field)`

This module imports nothing from jaxinfer (`backend` reads it).
"""

from __future__ import annotations

import functools
import json
import pathlib

TABLE_DIR = pathlib.Path(__file__).parent / "kernel_tables"
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")  # sm90: wgmma, the Mosaic kernels'
ROW_FIELDS = ("kernel", "ran", "matched", "ms", "ours_ms")  # what `choose` reads of a row
# Backend field -> (the table's kernel, {candidate as kernel_bench names it: the field's value}).
# "ours" under dense_attention is our flash kernel (the field's "ours"); under
# grouped_matmul it is jax's ragged_dot_mgpu through ops.grouped_matmul ("mosaic").
CHOICES = {
    "dense_attention": ("flash", {"ours": "ours", "cudnn": "cudnn", "xla": "jax_nn",
                                  "tokamax_mosaic": "tokamax", "tokamax_triton": "tokamax"}),
    "grouped_matmul": ("gmm", {"ours": "mosaic", "xla_ragged_dot": "xla",
                               "tokamax_mosaic": "tokamax"}),
}


def choose(table: dict | None, field: str) -> str | None:
  """The `field` default a winner table gives (None: the built-in default):
  the candidate of `CHOICES[field]` with the least total time over the
  table's rows of that kernel, ours' time standing in where it did not
  run, among those that matched in some row and mismatched in none."""
  kernel, values = CHOICES[field]
  if table is None or not any(k in table["meta"]["device_kind"] for k in HOPPER_KINDS):
    return None
  rows = [r for r in table["rows"] if r["kernel"] == kernel]
  totals = {}
  for name in values:
    ran = [r for r in rows if name in r["ran"]]
    if not ran or any(name not in r["matched"] for r in ran):
      continue
    stand_in = [r["ours_ms"] for r in rows if name not in r["ran"]]
    if None in stand_in:
      continue  # a case neither it nor ours ran: no total to compare
    totals[name] = sum(r["ms"][name] for r in ran) + sum(stand_in)
  return values[min(totals, key=totals.get)] if totals else None


@functools.lru_cache(maxsize=None)
def latest(directory: str = str(TABLE_DIR)) -> dict | None:
  """The committed winner table with the newest date (meta.date), or None;
  a table that is not one raises ValueError naming its file."""
  tables = []
  for path in sorted(pathlib.Path(directory).glob("kernel_winners_*.json")):
    try:
      table = json.loads(path.read_text())
      date, rows = table["meta"]["date"], table["rows"]
      missing = sorted({f for r in rows for f in ROW_FIELDS if f not in r})
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"kernel winner table {path}: not a winner table ({e!r})") from e
    if missing:
      raise ValueError(f"kernel winner table {path}: rows lack {missing}")
    tables.append((date, path.name, table))
  return max(tables)[2] if tables else None


def hopper_default(field: str) -> str | None:
  """`field`'s default from the newest committed table (None: built-in)."""
  return choose(latest(), field)
