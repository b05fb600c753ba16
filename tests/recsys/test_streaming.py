"""jaxinfer.recsys.streaming against MLPerf's DLRMv3 streaming reader.

A tiny data set is written in the generator's layout (streaming_fixture) and
read back; each request is compared with what the reference's `_process_line`
and `load_item` give, re-derived here from the written slots the way they do
it (string joins, the feature lists cast with torch.tensor(list).long()).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from jaxinfer.recsys import streaming
from streaming_fixture import write_offsets, write_tiny_dataset

TRAIN_TS, TOTAL_TS = 2, 4  # slots: 0 base, 1-2 train 0-1, 3 eval, 4-5 inference 2-3
NUM_ITEMS, NUM_CATEGORIES = 64_000_000, 8  # ids above 2**24: float32 rounds them
PER_CATEGORY = NUM_ITEMS // NUM_CATEGORIES


def _slot(user: int, slot: int, n_hist: int, n_cand: int):
  """Ids that say where they come from; ratings 1.0..5.0 with fractions."""
  base = 30_000_000 + user * 100_000 + slot * 1_000 + 1  # odd, > 2**24
  n = max(n_hist, n_cand)
  ids = [base + 2 * k + (k % 3) * 5_000_001 for k in range(n)]
  ratings = [1.0 + ((user + slot + k) % 17) / 4.25 for k in range(n)]
  return ids[:n_cand], ratings[:n_cand], ids[:n_hist], ratings[:n_hist]


def _users():
  """Four users; user 1 skips train ts 1, user 2 inference ts 2, user 3 both."""
  users = []
  for u in range(4):
    slots = [_slot(u, s, 5 + s + u, 3 + u % 2) for s in range(TOTAL_TS + 2)]
    slots[4] = _slot(u, 4, 3, 6)  # inference: history a subsample of the candidates
    if u in (1, 3):
      slots[2] = None
    if u in (2, 3):
      slots[4] = None
    users.append(slots)
  return users


@pytest.fixture
def folder(tmp_path):
  write_tiny_dataset(tmp_path, _users(), train_ts=TRAIN_TS, total_ts=TOTAL_TS, num_files=2)
  return tmp_path


def _dataset(folder, **kw):
  args = dict(num_users=4, num_files=2, num_items=NUM_ITEMS, num_categories=NUM_CATEGORIES,
              train_ts=TRAIN_TS, total_ts=TOTAL_TS)
  return streaming.StreamingDataset(folder, **{**args, **kw})


def _reference(slots, user, mode, ts, max_uih_len, max_candidates):
  """The model's features as the reference's _process_line + load_item build them."""
  hist_ids, hist_ratings = [], []
  first = range(TRAIN_TS + 1) if mode == "inference" else range(ts + 1)
  later = range(TRAIN_TS + 2, ts + 2) if mode == "inference" else range(0)
  for i in [*first, *later]:
    if slots[i] is not None:  # the reference tests the candidate-ids field
      hist_ids += slots[i][2]
      hist_ratings += slots[i][3]
  cand_ids, cand_ratings = slots[ts + 2 if mode == "inference" else ts + 1][:2]
  ids, ratings = hist_ids[:max_uih_len], hist_ratings[:max_uih_len]
  cand_ids, cand_ratings = cand_ids[:max_candidates], cand_ratings[:max_candidates]
  n, c = len(ids), len(cand_ids)
  query = 0 if n == 0 else 1
  uih = torch.tensor([user] + ids + ratings + [1] * n + [2 ** (int(r) - 1) for r in ratings]
                     + [0] * n + [i // PER_CATEGORY for i in ids] + [query]).long().tolist()
  cand = torch.tensor(cand_ids + cand_ratings + [query] * c + [int(r >= 3.5) for r in cand_ratings]
                      + [1] * c + [i // PER_CATEGORY for i in cand_ids]).long().tolist()
  cut = lambda xs, sizes: [xs[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(len(sizes))]
  u = cut(uih, [1] + [n] * 6 + [1])
  return dict(user_id=u[0][0], item_ids=u[1], ratings=u[2], timestamps=u[3], weights=u[4],
              category_ids=u[6], query_time=u[7][0], candidate_ids=cut(cand, [c] * 6)[0],
              candidate_rating_feature=cut(cand, [c] * 6)[1], labels=cut(cand, [c] * 6)[3],
              query_times=cut(cand, [c] * 6)[2], candidate_category_ids=cut(cand, [c] * 6)[5])


def _assert_matches(r, want):
  assert r.user_id == want["user_id"]
  for f in ("item_ids", "ratings", "timestamps", "category_ids", "candidate_ids",
            "candidate_category_ids"):
    assert getattr(r, f).tolist() == want[f], f
  assert r.action_weights.tolist() == want["weights"]
  assert r.query_time == want["query_time"]
  assert [r.query_time] * len(r.candidate_ids) == want["query_times"]
  assert r.labels.astype(int).tolist() == want["labels"]
  assert r.candidate_ratings.astype(np.float32).astype(np.int64).tolist() == \
      want["candidate_rating_feature"]


@pytest.mark.parametrize("mode", ["train", "eval", "inference"])
@pytest.mark.parametrize("max_uih_len,max_candidates", [(14335, 2048), (7, 2)])
def test_every_request_equals_the_reference(folder, mode, max_uih_len, max_candidates):
  users = _users()
  ds = _dataset(folder, mode=mode, max_uih_len=max_uih_len, max_candidates=max_candidates)
  seen = 0
  for ts in ds.timestamps:
    ds.set_ts(ts)
    assert len(ds) > 0
    for i in range(len(ds)):
      user = int(ds.user_ids[i])
      want = _reference(users[user], user, mode, ts, max_uih_len, max_candidates)
      _assert_matches(ds.request(i), want)
      seen += 1
  assert seen >= 4


def test_requests_are_the_users_sampled_at_each_timestamp(folder):
  ds = _dataset(folder, mode="train")
  assert ds.requests_at(0).tolist() == [0, 1, 2, 3]
  assert ds.requests_at(1).tolist() == [0, 2]  # users 1 and 3 skip train ts 1
  inference = _dataset(folder)
  assert inference.timestamps == range(TRAIN_TS, TOTAL_TS)
  assert inference.requests_at(2).tolist() == [0, 1]  # users 2 and 3 skip inference ts 2
  assert inference.requests_at(3).tolist() == [0, 1, 2, 3]
  # The eval slot holds every user, but eval reads the requests of ts = train_ts.
  assert _dataset(folder, mode="eval").requests_at(TRAIN_TS).tolist() == [0, 1]


def test_slots_per_mode(folder):
  """Which slots become history: written out for user 1 (skips train ts 1)."""
  u = _users()[1]
  kw = dict(float32_features=False)
  train = _dataset(folder, mode="train", **kw)
  train.set_ts(0)
  r = train.request(1)
  assert r.item_ids.tolist() == u[0][2] and r.candidate_ids.tolist() == u[1][0]
  ev = _dataset(folder, mode="eval", **kw)
  ev.set_ts(TRAIN_TS)
  r = ev.request(1)  # base + train ts 0 (train ts 1 unsampled); candidates: the eval slot
  assert r.item_ids.tolist() == u[0][2] + u[1][2] and r.candidate_ids.tolist() == u[3][0]
  inf = _dataset(folder, **kw)
  inf.set_ts(3)
  r = inf.request(1)  # the eval slot is skipped, inference ts 2 joins the history
  assert r.item_ids.tolist() == u[0][2] + u[1][2] + u[4][2]
  assert r.candidate_ids.tolist() == u[5][0]
  assert r.timestamps.tolist() == [1] * len(r.item_ids) and r.query_time == 1
  assert r.labels.tolist() == [float(x >= 3.5) for x in u[5][1]]


def test_truncation_keeps_the_oldest_history_and_first_candidates(folder):
  u = _users()[0]
  ds = _dataset(folder, max_uih_len=3, max_candidates=2, float32_features=False)
  ds.set_ts(3)
  r = ds.request(0)
  assert r.item_ids.tolist() == u[0][2][:3]
  assert r.candidate_ids.tolist() == u[5][0][:2]


def test_float32_rounding_as_the_reference(tmp_path):
  slots = [([5], [2.0], [7], [4.0])] * (TOTAL_TS + 2)
  slots[4] = ([123_456_789, 7_812_499, 999_999_968], [3.75, 3.25, 1.0], [123_456_789], [3.75])
  write_tiny_dataset(tmp_path, [slots], train_ts=TRAIN_TS, total_ts=TOTAL_TS)
  kw = dict(num_users=1, num_files=1, train_ts=TRAIN_TS, total_ts=TOTAL_TS)
  ds = streaming.StreamingDataset(tmp_path, **kw)  # 1B items, 128 categories
  exact = streaming.StreamingDataset(tmp_path, float32_features=False, **kw)
  ds.set_ts(3), exact.set_ts(3)
  r, e = ds.request(0), exact.request(0)
  assert r.item_ids.tolist() == [7, 7, 7, 123_456_792]  # base, train 0, train 1, inference 2
  assert e.item_ids.tolist() == [7, 7, 7, 123_456_789]
  assert r.ratings.tolist() == [4, 4, 4, 3] and r.action_weights.tolist()[-1] == 4
  assert r.category_ids.tolist()[-1] == 123_456_789 // 7_812_500  # from the exact id
  assert r.candidate_ids.tolist() == [5] and r.labels.tolist() == [0.0]
  ds.set_ts(2)
  r = ds.request(0)
  # The last id becomes 10**9, one past the 1B-row item table, as in the reference.
  assert r.candidate_ids.tolist() == [123_456_792, 7_812_499, 1_000_000_000]
  assert r.candidate_category_ids.tolist() == [15, 0, 127]
  assert r.labels.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ["offset.csv", "requests_per_ts_offset.csv",
                                  "users_cumsum_per_ts.csv", "requests_per_ts.csv", "1.csv"])
def test_a_missing_file_is_named(folder, name):
  os.remove(folder / name)
  with pytest.raises(FileNotFoundError, match=f"{folder / name} is missing"):
    ds = _dataset(folder)
    ds.set_ts(3)
    ds.request(3)  # user 3, in file 1


def _edit_row(folder, file_idx: int, row: int, edit) -> None:
  """Rewrite one row of a data file, then offset.csv as the generator would."""
  path = folder / f"{file_idx}.csv"
  lines = path.read_bytes().split(b"\r\n")
  lines[row] = edit(lines[row].decode()).encode()
  path.write_bytes(b"\r\n".join(lines))
  write_offsets(folder, 2)


def test_a_row_with_the_wrong_number_of_fields(folder):
  _edit_row(folder, 1, 0, lambda line: line + ",")
  ds = _dataset(folder)
  ds.set_ts(3)
  with pytest.raises(ValueError, match=r"1\.csv line 1 \(user 2\): 25 fields, expected .* = 24"):
    ds.request(2)
  assert ds.request(3).user_id == 3  # the other rows still read


@pytest.mark.parametrize("slot,bad,match", [
    ((["x7"], [2.0], [1], [4.0]), 5, r"slot 5 \(inference ts 3\) candidate ids: 'x7' is not an"),
    (([1], [2.0], [1, "2.5"], [4.0, 3.0]), 0, r"slot 0 \(base history\) history ids: '2.5' is not"),
    (([1], [2.0], [1], ["four"]), 0, r"slot 0 \(base history\) history ratings: 'four' is not a n"),
    (([1], [2.0], [1, 2], [4.0]), 0, r"slot 0 \(base history\) history ratings: 1 ratings for 2"),
    (([1], [2.0], [NUM_ITEMS], [4.0]), 1, r"history ids: item id 64000000 is outside the item "
                                          r"range \[0, 64000000\)"),
    (([-1], [2.0], [1], [4.0]), 5, r"slot 5 \(inference ts 3\) candidate ids: item id -1 is out"),
    (([1], [2.0], [1], [0.5]), 0, r"history ratings: 0.5..3.82.* outside \[1, 6\)"),
    (([1], ["nan"], [1], [2.0]), 5, r"slot 5 \(inference ts 3\) candidate ratings: 'nan' is not f"),
], ids=["candidate id", "history id", "rating", "count", "id range", "negative id", "rating range",
        "nan rating"])
def test_bad_values_name_the_file_line_user_and_field(tmp_path, slot, bad, match):
  users = _users()
  users[2][bad] = slot
  write_tiny_dataset(tmp_path, users, train_ts=TRAIN_TS, total_ts=TOTAL_TS, num_files=2)
  ds = _dataset(tmp_path)
  ds.set_ts(3)
  with pytest.raises(ValueError, match=r"1\.csv line 1 \(user 2\), " + match):
    ds.request(2)
  assert ds.request(1).user_id == 1


@pytest.mark.parametrize("mode,ts,allowed", [
    ("train", 2, r"\[0, 2\)"), ("train", -1, r"\[0, 2\)"), ("eval", 3, r"\[0, 3\)"),
    ("inference", 1, r"\[2, 4\)"), ("inference", 4, r"\[2, 4\)")])
def test_ts_out_of_range(folder, mode, ts, allowed):
  ds = _dataset(folder, mode=mode)
  with pytest.raises(ValueError, match=f"ts {ts} is out of range for {mode} mode: {allowed}"):
    ds.set_ts(ts)
  assert ds.ts is None and len(ds) == 0


def test_request_index_and_order_of_calls(folder):
  ds = _dataset(folder)
  with pytest.raises(ValueError, match="call set_ts first"):
    ds.request(0)
  ds.set_ts(2)
  with pytest.raises(IndexError, match="request 2 is out of range: ts 2 has 2 requests"):
    ds.request(2)
  with pytest.raises(ValueError, match="mode must be one of"):
    _dataset(folder, mode="training")



def test_rows_are_read_by_byte_offset(folder):
  ds = _dataset(folder)
  ds.set_ts(3)
  _edit_row(folder, 1, 0, lambda line: "garbage")  # user 2; offset.csv rewritten
  assert ds.request(3).user_id == 3  # user 3's row, found by its offset, reads unchanged
  (folder / "offset.csv").write_text('"0,7"\r\n"0,5"\r\n')  # 5: inside user 2's row
  stale = _dataset(folder)
  stale.set_ts(3)
  with pytest.raises(ValueError, match=r"byte offset 5 of .*1\.csv does not start a line"):
    stale.request(3)


def test_offset_rows_must_hold_each_file_s_users(folder):
  ds = _dataset(folder, num_users=6, num_files=2)  # 3 users per file: offset.csv has 2
  ds.set_ts(3)
  with pytest.raises(ValueError, match=r"offset\.csv line 1: 2 offsets, expected 3"):
    ds.request(0)
  with pytest.raises(ValueError, match=r"offset\.csv has 2 rows, expected at least 3"):
    _dataset(folder, num_users=6, num_files=3)


def test_the_sampled_data_set_reads_file_0_only(tmp_path):
  """copy_sub_dataset keeps 0.csv and the full metadata; requests of the other
  files are out of its reach (the reference would open a missing file)."""
  users = _users()
  write_tiny_dataset(tmp_path / "sampled_data", users, train_ts=TRAIN_TS, total_ts=TOTAL_TS,
                     num_files=2)
  os.remove(tmp_path / "sampled_data" / "1.csv")
  ds = streaming.reference_dataset("sampled-streaming-100b", tmp_path, num_users=2,
                                   num_items=NUM_ITEMS, num_categories=NUM_CATEGORIES,
                                   train_ts=TRAIN_TS, total_ts=TOTAL_TS)
  assert ds.num_files == 1 and ds.users_per_file == 2 and ds.num_timestamps == TOTAL_TS
  ds.set_ts(3)
  want = _reference(users[1], 1, "inference", 3, streaming.MAX_UIH_LEN, streaming.MAX_CANDIDATES)
  _assert_matches(ds.request(1), want)
  with pytest.raises(ValueError, match=r"request 2 \(user 2\) falls in file 1 .* 1 files of 2"):
    ds.request(2)
  with pytest.raises(FileNotFoundError, match=r"nowhere.sampled_data.offset\.csv is missing"):
    streaming.reference_dataset("sampled-streaming-100b", tmp_path / "nowhere")
  with pytest.raises(ValueError, match="unknown data set 'streaming-1b'"):
    streaming.reference_dataset("streaming-1b", tmp_path)


def test_defaults_are_the_benchmark_s():
  assert (streaming.MAX_UIH_LEN, streaming.MAX_CANDIDATES) == (14335, 2048)
  assert streaming.slot_groups(streaming.Mode.INFERENCE, 92, 90) == ([*range(91), 92, 93], 94)
  assert streaming.slot_groups(streaming.Mode.EVAL, 90, 90) == (list(range(91)), 91)
  assert streaming.slot_name(91, 90) == "slot 91 (eval)"
