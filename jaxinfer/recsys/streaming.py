"""MLPerf's DLRMv3 streaming data set, read from the generator's folder.

MLPerf Inference's DLRMv3 reference generates its data set with
`streaming_synthetic_data.py` and reads it with `datasets/synthetic_streaming.py`
(`DLRMv3SyntheticStreamingDataset`). This module reads the same folder and
returns, per request, the `DlrmRequest` holding what the reference's
`load_item` feeds the model.

The folder (`num_files` files of `num_users // num_files` users, user u in
file u // users_per_file, row u % users_per_file):

  {f}.csv        one row per user, 4 * (total_ts + 2) fields: for each slot,
                 candidate ids, candidate ratings, history ids, history ratings
                 (comma-joined inside one CSV field; a slot the user was not
                 sampled at has 4 empty fields). Slots, in order: the base
                 history (slot 0), train timestamps 0..train_ts-1 (slots
                 1..train_ts), the eval slot (train_ts + 1), inference
                 timestamps train_ts..total_ts-1 (slots train_ts+2..total_ts+1)
  offset.csv     row f: the byte offset of each of file f's rows
  requests_per_ts.csv         row ts: the users sampled at ts, file by file
  requests_per_ts_offset.csv  one row: the byte offset of each of its rows
  users_cumsum_per_ts.csv     row ts: the cumulative request count per file
  ts_{f}_{ts}.csv             the generator's per-file lists (not read)

Request i at timestamp ts is user requests[ts][i], in the first file whose
cumulative count exceeds i. Which slots make its features (`slot_groups`):

  train (0 <= ts < train_ts): history = slots 0..ts, candidates = slot ts + 1
  eval  (0 <= ts <= train_ts): the same; ts = train_ts reads the eval slot
  inference (train_ts <= ts < total_ts): history = slots 0..train_ts (base and
    train, not eval) + the earlier inference slots train_ts+2..ts+1,
    candidates = slot ts + 2

A history slot counts only where its candidate-ids field is non-empty (the
reference tests that field). MLPerf's runs, accuracy ones included, use
inference mode (main.py's StreamingQuerySampler sets `is_inference`) with
2048 candidates and histories of 16384 - 2048 - 1 = 14335 (max_seq_len less
the candidates and the user_id token). Truncation keeps the FIRST
`max_uih_len` events (the oldest: the base slot first) and the first
`max_candidates` candidates. Every history timestamp is 1, so the query time
is 1 (0 without history); categories are id // (num_items // num_categories);
a history event's action weight is action_weights[int(rating) - 1]; a
candidate's label is rating >= 3.5 (`DlrmRequest.labels`).

The reference builds each feature tensor with `torch.tensor(list).long()`:
ratings are written as floats ("3.75"), so the whole list, ids included,
passes through float32 before the cast. Item ids above 2**24 come out rounded
to float32's spacing (123456789 -> 123456792; ids from 999999968 on become
1000000000, one past a 1B-row table) and ratings truncated (3.75 -> 3).
`float32_features=True` (the default) reproduces that; False keeps the ids
as written. Candidate ratings stay exact (float64) for the labels, which the
reference computes before the cast.

Rows are read by byte offset, one user at a time; offset.csv rows are parsed
per file when first needed, requests_per_ts.csv one timestamp at a time.
"""

from __future__ import annotations

import enum
import os

import numpy as np

from jaxinfer.recsys.request import ACTION_WEIGHTS, DlrmRequest

FIELDS = ("candidate ids", "candidate ratings", "history ids", "history ratings")
MAX_SEQ_LEN = 16384  # DlrmHSTUConfig.max_seq_len
MAX_CANDIDATES = 2048  # configs.py max_num_candidates_inference (main.py uses it)
MAX_UIH_LEN = MAX_SEQ_LEN - MAX_CANDIDATES - 1  # less the user_id token


class Mode(enum.Enum):
  """Which slots make a request's history and candidates (module docstring)."""
  TRAIN = "train"
  EVAL = "eval"
  INFERENCE = "inference"


def ts_range(mode: Mode, train_ts: int, total_ts: int) -> range:
  """The timestamps `mode` may read."""
  return {Mode.TRAIN: range(0, train_ts), Mode.EVAL: range(0, train_ts + 1),
          Mode.INFERENCE: range(train_ts, total_ts)}[mode]


def slot_groups(mode: Mode, ts: int, train_ts: int) -> tuple[list[int], int]:
  """(history slots, candidate slot) the reference's `_process_line` reads at ts."""
  if mode is Mode.INFERENCE:
    return list(range(train_ts + 1)) + list(range(train_ts + 2, ts + 2)), ts + 2
  return list(range(ts + 1)), ts + 1


def split_row(text: str) -> list[str]:
  """Fields of one CSV row as csv.writer writes them (quoted when they hold
  commas; the data never holds quotes). No csv module: its field size limit
  is process-global and the reference raises it to sys.maxsize."""
  parts = text.split('"')
  if len(parts) % 2 == 0:
    raise ValueError("unbalanced quote")
  fields, current = [], ""
  for i, part in enumerate(parts):
    if i % 2:
      current += part
      continue
    pieces = part.split(",")
    current += pieces[0]
    for piece in pieces[1:]:
      fields.append(current)
      current = piece
  fields.append(current)
  return fields


def read_line(path: str, offset: int, what: str) -> str:
  """The line starting at byte `offset` of `path` (no line end), checked to
  start a line."""
  with open(path, "rb") as f:
    if offset > 0:
      f.seek(offset - 1)
      if f.read(1) != b"\n":
        raise ValueError(f"{what}: byte offset {offset} of {path} does not start a line")
    else:
      f.seek(offset)
    line = f.readline()
  if not line:
    raise ValueError(f"{what}: byte offset {offset} is past the end of {path}")
  return line.rstrip(b"\r\n").decode("ascii", errors="replace")


def parse_ints(field: str, where: str) -> np.ndarray:
  """A comma-joined integer list (a bare or quoted field); "" is empty."""
  field = field.strip().strip('"')
  if not field:
    return np.zeros((0,), np.int64)
  tokens = field.split(",")
  try:
    return np.array(tokens).astype(np.int64)
  except ValueError:
    bad = next(t for t in tokens if not t.strip().lstrip("+-").isdigit())
    raise ValueError(f"{where}: {bad!r} is not an integer") from None


def parse_floats(field: str, where: str) -> tuple[np.ndarray, np.ndarray]:
  """(values, written as a float) of a comma-joined number list."""
  tokens = field.split(",") if field else []
  try:
    values = np.array(tokens, dtype=np.float64) if tokens else np.zeros((0,))
  except ValueError:
    bad = next(t for t in tokens if not _is_number(t))
    raise ValueError(f"{where}: {bad!r} is not a number") from None
  if not np.isfinite(values).all():
    raise ValueError(f"{where}: {tokens[int(np.argmin(np.isfinite(values)))]!r} is not finite")
  is_float = np.array([not t.strip().lstrip("+-").isdigit() for t in tokens], bool)
  return values, is_float


def _is_number(token: str) -> bool:
  try:
    float(token)
  except ValueError:
    return False
  return True


def through_float32(a: np.ndarray, on: bool) -> np.ndarray:
  """Integers as torch.tensor(list).long() leaves them when the list held a float."""
  return a.astype(np.float32).astype(np.int64) if on else a


def _mode(mode) -> Mode:
  try:
    return Mode(mode)
  except ValueError:
    raise ValueError(f"mode must be one of {[m.value for m in Mode]}, got {mode!r}") from None


def slot_name(slot: int, train_ts: int) -> str:
  """The generator's name of a row's slot (module docstring)."""
  if slot == 0:
    return "slot 0 (base history)"
  if slot <= train_ts:
    return f"slot {slot} (train ts {slot - 1})"
  if slot == train_ts + 1:
    return f"slot {slot} (eval)"
  return f"slot {slot} (inference ts {slot - 2})"


def _pair(fields: list[str], slot: int, first: int, where: str, train_ts: int):
  """(ids, ratings, ratings written as floats) of fields 4 * slot + first, + 1."""
  at = [f"{where}, {slot_name(slot, train_ts)} {FIELDS[first + k]}" for k in (0, 1)]
  ids = parse_ints(fields[4 * slot + first], at[0])
  ratings, is_float = parse_floats(fields[4 * slot + first + 1], at[1])
  if len(ids) != len(ratings):
    raise ValueError(f"{at[1]}: {len(ratings)} ratings for {len(ids)} ids")
  return ids, ratings, is_float


def _check_ids(ids: np.ndarray, num_items: int, where: str) -> None:
  bad = (ids < 0) | (ids >= num_items)
  if bad.any():
    raise ValueError(f"{where}: item id {ids[bad][0]} is outside the item range "
                     f"[0, {num_items})")


def row_request(fields: list[str], user_id: int, where: str, *, slots: tuple[list[int], int],
                train_ts: int, num_items: int, num_categories: int, max_uih_len: int,
                max_candidates: int, float32_features: bool = True) -> DlrmRequest:
  """The request `load_item` builds from one user's row (module docstring).

  slots: (history slots, candidate slot) from `slot_groups`; where: the row's
  file and line, for errors.
  """
  hist = [_pair(fields, s, 2, where, train_ts) for s in slots[0] if fields[4 * s]]
  for s, (ids, _, _) in zip([s for s in slots[0] if fields[4 * s]], hist):
    if not len(ids):
      raise ValueError(f"{where}, {slot_name(s, train_ts)}: candidates but no history ids")
  ids, ratings, is_float = (
      np.concatenate([np.zeros((0,), dtype)] + [h[k] for h in hist])[:max_uih_len]
      for k, dtype in enumerate((np.int64, np.float64, bool)))
  _check_ids(ids, num_items, f"{where}, history ids")
  if len(ratings) and (ratings.min() < 1 or ratings.max() >= len(ACTION_WEIGHTS) + 1):
    raise ValueError(f"{where}, history ratings: {ratings.min()}..{ratings.max()} outside "
                     f"[1, {len(ACTION_WEIGHTS) + 1}) (action_weights[int(rating) - 1])")
  cand, cand_ratings, cand_float = _pair(fields, slots[1], 0, where, train_ts)
  if not len(cand):
    raise ValueError(f"{where}, {slot_name(slots[1], train_ts)}: no candidates (the user "
                     "is a request at this timestamp)")
  _check_ids(cand, num_items, f"{where}, {slot_name(slots[1], train_ts)} candidate ids")
  cand, cand_ratings, cand_float = (a[:max_candidates] for a in (cand, cand_ratings, cand_float))
  per_category = num_items // num_categories
  uih32, cand32 = float32_features and is_float.any(), float32_features and cand_float.any()
  return DlrmRequest(
      user_id=int(through_float32(np.array([user_id]), uih32)[0]),
      item_ids=through_float32(ids, uih32),
      ratings=(ratings.astype(np.float32) if uih32 else ratings).astype(np.int64),
      timestamps=np.ones(len(ids), np.int64),
      category_ids=ids // per_category,
      candidate_ids=through_float32(cand, cand32),
      candidate_category_ids=cand // per_category,
      query_time=1 if len(ids) else 0,
      candidate_ratings=cand_ratings)


def _line_starts(path: str, n: int, what: str) -> list[int]:
  """Byte offsets of the first n lines of `path` (reading it once, line by line)."""
  starts = []
  with open(path, "rb") as f:
    while len(starts) < n:
      at = f.tell()
      if not f.readline():
        raise ValueError(f"{path} has {len(starts)} rows, expected at least {n} ({what})")
      starts.append(at)
  return starts


class StreamingDataset:
  """The requests of one timestamp of MLPerf's streaming data set (module docstring).

  Defaults are the reference's "streaming-100b" (datasets' get_dataset, main.py):
  100 files of 50k users, 1B items in 128 categories, 90 train timestamps of
  100, inference mode, 2048 candidates, histories of 14335.
  """

  def __init__(self, folder: str | os.PathLike, *, num_users: int = 5_000_000,
               num_files: int = 100, num_items: int = 1_000_000_000, num_categories: int = 128,
               train_ts: int = 90, total_ts: int = 100, mode: Mode | str = Mode.INFERENCE,
               max_uih_len: int = MAX_UIH_LEN, max_candidates: int = MAX_CANDIDATES,
               float32_features: bool = True):
    for name, v in (("num_users", num_users), ("num_files", num_files),
                    ("num_items", num_items), ("num_categories", num_categories),
                    ("total_ts", total_ts), ("max_uih_len", max_uih_len),
                    ("max_candidates", max_candidates)):
      if v < 1:
        raise ValueError(f"StreamingDataset: {name} must be >= 1, got {v}")
    if not 0 < train_ts < total_ts:
      raise ValueError(f"StreamingDataset: train_ts must be in [1, total_ts={total_ts}), "
                       f"got {train_ts}")
    if num_users < num_files or num_items < num_categories:
      raise ValueError(f"StreamingDataset: {num_users} users in {num_files} files, "
                       f"{num_items} items in {num_categories} categories")
    self.folder, self.mode = os.fspath(folder), _mode(mode)
    self.num_files, self.users_per_file = num_files, num_users // num_files
    self.train_ts, self.total_ts = train_ts, total_ts
    self._row_args = dict(train_ts=train_ts, num_items=num_items, num_categories=num_categories,
                          max_uih_len=max_uih_len, max_candidates=max_candidates,
                          float32_features=float32_features)
    self._offset_rows = _line_starts(self.path("offset.csv"), num_files,
                                     "one row of byte offsets per data file")
    self._file_offsets: dict[int, np.ndarray] = {}
    where = f"{self.path('requests_per_ts_offset.csv')} line 1"
    self._ts_offsets = parse_ints(read_line(self.path("requests_per_ts_offset.csv"), 0, where),
                                  where)
    if len(self._ts_offsets) != total_ts:
      raise ValueError(f"{where}: {len(self._ts_offsets)} offsets, expected total_ts={total_ts}")
    cumsum = self.path("users_cumsum_per_ts.csv")
    self._cumsum = [parse_ints(read_line(cumsum, at, f"{cumsum} line {t + 1}"),
                               f"{cumsum} line {t + 1}")
                    for t, at in enumerate(_line_starts(cumsum, total_ts, "one row per ts"))]
    self.ts: int | None = None
    self._users = np.zeros((0,), np.int64)

  def path(self, name: str) -> str:
    """A file of the folder; FileNotFoundError naming it if it is missing."""
    p = os.path.join(self.folder, name)
    if not os.path.isfile(p):
      raise FileNotFoundError(f"streaming data set: {p} is missing (the generator writes "
                              f"{name} in the data set's folder)")
    return p

  @property
  def num_timestamps(self) -> int:
    return self.total_ts

  @property
  def timestamps(self) -> range:
    """The timestamps this mode reads (module docstring)."""
    return ts_range(self.mode, self.train_ts, self.total_ts)

  @property
  def user_ids(self) -> np.ndarray:
    """The current timestamp's requests, as user ids."""
    return self._users

  def __len__(self) -> int:
    return len(self._users)

  def requests_at(self, ts: int) -> np.ndarray:
    """The user ids of timestamp ts's requests (requests_per_ts.csv row ts)."""
    if ts not in self.timestamps:
      raise ValueError(f"ts {ts} is out of range for {self.mode.value} mode: "
                       f"[{self.timestamps.start}, {self.timestamps.stop})")
    path = self.path("requests_per_ts.csv")
    where = f"{path} line {ts + 1} (ts {ts})"
    users = parse_ints(read_line(path, int(self._ts_offsets[ts]), where), where)
    expected = int(self._cumsum[ts][-1]) if len(self._cumsum[ts]) else 0
    if len(users) != expected:
      raise ValueError(f"{where}: {len(users)} requests, users_cumsum_per_ts.csv line "
                       f"{ts + 1} counts {expected}")
    return users

  def set_ts(self, ts: int) -> None:
    """Make ts the current timestamp (its requests numbered 0..len - 1)."""
    self._users = self.requests_at(ts)
    self.ts = ts

  def request(self, idx: int) -> DlrmRequest:
    """Request idx of the current timestamp, as the reference's iloc + load_item."""
    if self.ts is None:
      raise ValueError("StreamingDataset.request: no timestamp set (call set_ts first)")
    if not 0 <= idx < len(self._users):
      raise IndexError(f"request {idx} is out of range: ts {self.ts} has {len(self)} requests")
    cumsum = self._cumsum[self.ts]
    file_idx = int(np.searchsorted(cumsum, idx, side="right"))
    user = int(self._users[idx])
    if file_idx >= self.num_files or user // self.users_per_file != file_idx:
      raise ValueError(
          f"requests_per_ts.csv line {self.ts + 1}: request {idx} (user {user}) falls in file "
          f"{file_idx} by users_cumsum_per_ts.csv line {self.ts + 1}, but the data set has "
          f"{self.num_files} files of {self.users_per_file} users")
    row = user % self.users_per_file
    path = self.path(f"{file_idx}.csv")
    where = f"{path} line {row + 1} (user {user})"
    fields = split_row(read_line(path, int(self._offsets(file_idx)[row]), where))
    if len(fields) != 4 * (self.total_ts + 2):
      raise ValueError(f"{where}: {len(fields)} fields, expected 4 * (total_ts + 2) = "
                       f"{4 * (self.total_ts + 2)}")
    return row_request(fields, user, where, slots=slot_groups(self.mode, self.ts, self.train_ts),
                       **self._row_args)

  def _offsets(self, file_idx: int) -> np.ndarray:
    """Byte offsets of file_idx's rows (offset.csv row file_idx), parsed once."""
    if file_idx not in self._file_offsets:
      path = self.path("offset.csv")
      where = f"{path} line {file_idx + 1}"
      offsets = parse_ints(read_line(path, self._offset_rows[file_idx], where), where)
      if len(offsets) != self.users_per_file:
        raise ValueError(f"{where}: {len(offsets)} offsets, expected {self.users_per_file} "
                         "(users per file)")
      self._file_offsets[file_idx] = offsets
    return self._file_offsets[file_idx]


# The reference's data sets (datasets/utils.py get_dataset): folder under the
# path prefix and the arguments that differ from StreamingDataset's defaults.
REFERENCE_DATASETS = {
    "streaming-100b": ("", {}),
    # copy_sub_dataset's sampled_data/: file 0.csv only, the full metadata.
    "sampled-streaming-100b": ("sampled_data", {"num_files": 1, "num_users": 50_000}),
}


def reference_dataset(name: str, prefix: str | os.PathLike, **overrides) -> StreamingDataset:
  """The reference's data set `name` under `prefix` (its --dataset-path-prefix)."""
  if name not in REFERENCE_DATASETS:
    raise ValueError(f"unknown data set {name!r}; choose from {sorted(REFERENCE_DATASETS)}")
  sub, kwargs = REFERENCE_DATASETS[name]
  return StreamingDataset(os.path.join(os.fspath(prefix), sub), **{**kwargs, **overrides})
