"""A tiny data set in the layout of MLPerf's streaming DLRMv3 generator (test-only).

`write_tiny_dataset` writes what `streaming_synthetic_data.py` writes
(`write_dataset`, `write_offset`, `write_ts_metadata`), for users given slot by
slot instead of generated: csv.writer rows in text mode (so "\\r\\n" line
ends and list fields quoted), byte offsets of each row from `tell()`, the
per-file timestamp lists concatenated file by file.

A user is a list of total_ts + 2 slots (base, train 0..train_ts-1, eval,
inference train_ts..total_ts-1); a slot is None (not sampled: four empty
fields) or (candidate ids, candidate ratings, history ids, history ratings).
A user is a request at train or inference timestamp t when that slot is
sampled, as the generator records it; never at the base or eval slots.
Values given as strings are written as they are (malformed rows for tests);
`write_offsets` rewrites offset.csv after a test edits a data file.
"""

from __future__ import annotations

import csv
import os

import numpy as np


def _slot_ts(slot: int, train_ts: int) -> int | None:
  """The timestamp a slot records its user at (None: base and eval)."""
  if 1 <= slot <= train_ts:
    return slot - 1
  if slot >= train_ts + 2:
    return slot - 2
  return None


def _fields(slot) -> list[str]:
  if slot is None:
    return ["", "", "", ""]
  cand, cand_ratings, hist, hist_ratings = slot
  # Strings pass as written (tests inject malformed values).
  ints = lambda xs: ",".join(x if isinstance(x, str) else str(int(x)) for x in xs)
  floats = lambda xs: ",".join(x if isinstance(x, str) else str(float(x)) for x in xs)
  return [ints(cand), floats(cand_ratings), ints(hist), floats(hist_ratings)]


def _line_offsets(path: str) -> list[int]:
  offsets = []
  with open(path) as f:
    while True:
      at = f.tell()
      if not f.readline():
        return offsets
      offsets.append(at)


def _one_field_row(writer, values) -> None:
  writer.writerow([",".join(str(int(v)) for v in values)])


def write_tiny_dataset(folder: str | os.PathLike, users: list[list], *, train_ts: int,
                       total_ts: int, num_files: int = 1) -> None:
  """Write `users` (module docstring) in `num_files` files of len(users) // num_files."""
  folder = os.fspath(folder)
  os.makedirs(folder, exist_ok=True)
  per_file = len(users) // num_files
  assert per_file * num_files == len(users), "users must split evenly into the files"
  requests = [[[] for _ in range(num_files)] for _ in range(total_ts)]  # [ts][file] users
  for f in range(num_files):
    with open(os.path.join(folder, f"{f}.csv"), "w") as out:
      writer = csv.writer(out)
      for user in range(f * per_file, (f + 1) * per_file):
        slots = users[user]
        assert len(slots) == total_ts + 2, f"user {user}: {len(slots)} slots"
        for s, slot in enumerate(slots):
          if slot is not None and _slot_ts(s, train_ts) is not None:
            requests[_slot_ts(s, train_ts)][f].append(user)
        writer.writerow([x for slot in slots for x in _fields(slot)])
    for ts in range(total_ts):
      with open(os.path.join(folder, f"ts_{f}_{ts}.csv"), "w") as out:
        csv.writer(out).writerows([[u] for u in requests[ts][f]])
  write_offsets(folder, num_files)
  with open(os.path.join(folder, "requests_per_ts.csv"), "w") as req, \
       open(os.path.join(folder, "users_cumsum_per_ts.csv"), "w") as cum:
    for ts in range(total_ts):
      _one_field_row(csv.writer(req), [u for per in requests[ts] for u in per])
      _one_field_row(csv.writer(cum), np.cumsum([len(per) for per in requests[ts]]))
  with open(os.path.join(folder, "requests_per_ts_offset.csv"), "w") as out:
    _one_field_row(csv.writer(out), _line_offsets(os.path.join(folder, "requests_per_ts.csv")))


def write_offsets(folder: str | os.PathLike, num_files: int) -> None:
  """offset.csv from the data files as they now are (`write_offset`)."""
  with open(os.path.join(folder, "offset.csv"), "w") as out:
    writer = csv.writer(out)
    for f in range(num_files):
      _one_field_row(writer, _line_offsets(os.path.join(folder, f"{f}.csv")))
