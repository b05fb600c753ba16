"""`DlrmRequest`s packed on one token axis for `recsys.dlrm_v3` (no padding to
the longest user).

User u's tokens are [offsets[u], offsets[u + 1]):

  ctx, history_0 .. history_{h-1}, candidate_0 .. candidate_{c-1}

the contextual user_id token (item 0, timestamp 0, as the reference's zero
contextual timestamp), h history events (item, category, action bitmask,
action timestamp), c candidates (item, category, bitmask 0, timestamp
query_time: the reference's item_query_time). Buckets pad without changing
any real score: tokens past offsets[B] (each its own attention user), users
past the real ones (no tokens, no candidates) and candidate slots past the
real ones (candidate_index 0: the caller drops those scores).

`n` is the attention's 1/n denominator of this batch of requests:
max(history) + max(candidates) + 1 over the real users, what DlrmHSTU's
preprocessor makes max_seq_len (max_uih_len + max_num_candidates + the one
contextual token). It is an array, so batches of different lengths share one
compiled program; a request's scores depend on it (as the reference's do on
its batch).

`pack` checks every request on the host first and raises ValueError naming
the request (index and user_id), the field and the table.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jaxinfer.recsys.dlrm_config import DlrmV3Config
from jaxinfer.recsys.request import DlrmRequest

_INT32_MAX = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DlrmBatch:
  """Packed tokens (T), users (B), candidate slots (C); int32 arrays."""
  offsets: jax.Array  # [B + 1] token offsets per user
  num_candidates: jax.Array  # [B] candidates per user (its last tokens)
  user_ids: jax.Array  # [B] row of the user_id table (padding users: 0)
  item_ids: jax.Array  # [T] item_id rows (contextual and padding tokens: 0)
  category_ids: jax.Array  # [T] item_category_id rows
  action_weights: jax.Array  # [T] action bitmask (history only; else 0)
  timestamps: jax.Array  # [T] seconds (contextual: 0; candidates: query_time)
  candidate_index: jax.Array  # [C] token of each candidate (padding slots: 0)
  n: jax.Array  # [] the attention's 1/n denominator (module docstring)

  @property
  def num_tokens(self) -> int:
    return int(self.item_ids.shape[0])


def _bucket(name: str, n: int, bucket: int | None) -> int:
  if bucket is None:
    return max(n, 1)
  if not isinstance(bucket, (int, np.integer)) or bucket < max(n, 1):
    raise ValueError(f"{name} {bucket!r} is smaller than the {n} entries to pack (or not an "
                     f"int >= 1)")
  return int(bucket)


def _check_range(who: str, field: str, ids: np.ndarray, table: str, rows: int) -> None:
  if ids.size and (ids.min() < 0 or ids.max() >= rows):
    raise ValueError(f"{who}: {field} has ids out of table {table!r}'s range [0, {rows}): "
                     f"min {ids.min()}, max {ids.max()}")


def check_request(cfg: DlrmV3Config, k: int, r: DlrmRequest) -> None:
  """Host check of request k against cfg's tables and limits; ValueError naming
  the request, field and table."""
  if not isinstance(r, DlrmRequest):
    raise ValueError(f"request {k}: must be a recsys.request.DlrmRequest, got {type(r).__name__}")
  who = f"request {k} (user_id {r.user_id})"
  _check_range(who, "user_id", np.asarray([r.user_id]), "user_id", cfg.user_rows)
  for field, table, rows in (("item_ids", "item_id", cfg.item_rows),
                             ("candidate_ids", "item_id", cfg.item_rows),
                             ("category_ids", "item_category_id", cfg.category_rows),
                             ("candidate_category_ids", "item_category_id", cfg.category_rows)):
    _check_range(who, field, getattr(r, field), table, rows)
  c = len(r.candidate_ids)
  if c > cfg.max_num_candidates:
    raise ValueError(f"{who}: candidate_ids has {c} candidates, over max_num_candidates "
                     f"{cfg.max_num_candidates}")
  if r.num_tokens > cfg.max_seq_len:
    raise ValueError(f"{who}: item_ids ({len(r.item_ids)} events) + candidate_ids ({c}) + the "
                     f"contextual token make {r.num_tokens} tokens, over max_seq_len "
                     f"{cfg.max_seq_len}")
  times = np.concatenate([r.timestamps, [int(r.query_time)]])
  if times.min() < 0 or times.max() > _INT32_MAX:
    bad = "timestamps" if len(r.timestamps) and (
        r.timestamps.min() < 0 or r.timestamps.max() > _INT32_MAX) else "query_time"
    raise ValueError(f"{who}: {bad} must be seconds in [0, 2**31 - 1], got {times.min()}.."
                     f"{times.max()}")
  aw = r.action_weights
  if aw.size and (aw.min() < 0 or aw.max() > _INT32_MAX):
    raise ValueError(f"{who}: ratings give action bitmasks outside int32: {aw.min()}..{aw.max()}")


def _tokens(r: DlrmRequest):
  """One request's token arrays: items, categories, action bitmasks, timestamps."""
  c = len(r.candidate_ids)
  items = np.concatenate([[0], r.item_ids, r.candidate_ids])
  cats = np.concatenate([[0], r.category_ids, r.candidate_category_ids])
  actions = np.concatenate([[0], r.action_weights, np.zeros(c, np.int64)])
  times = np.concatenate([[0], r.timestamps, np.full(c, int(r.query_time), np.int64)])
  return items, cats, actions, times


def pack(cfg: DlrmV3Config, requests: Sequence[DlrmRequest], *, token_bucket: int | None = None,
         user_bucket: int | None = None, candidate_bucket: int | None = None) -> DlrmBatch:
  """Requests -> a `DlrmBatch` (numpy int32), padded to the given buckets (module
  docstring); ValueError naming the request, field and table of bad input."""
  requests = list(requests)
  if not requests:
    raise ValueError("requests: pack needs at least one request")
  for k, r in enumerate(requests):
    check_request(cfg, k, r)
  parts = [_tokens(r) for r in requests]
  lengths = [r.num_tokens for r in requests]
  ncand = [len(r.candidate_ids) for r in requests]
  R = len(requests)
  T = _bucket("token_bucket", sum(lengths), token_bucket)
  B = _bucket("user_bucket", R, user_bucket)
  C = _bucket("candidate_bucket", sum(ncand), candidate_bucket)
  offsets = np.zeros(B + 1, np.int64)
  offsets[1:R + 1] = np.cumsum(lengths)
  offsets[R + 1:] = offsets[R]
  cand = [offsets[u] + lengths[u] - ncand[u] + np.arange(ncand[u]) for u in range(R)]
  tok = lambda i: np.pad(np.concatenate([p[i] for p in parts]), (0, T - offsets[R]))
  pad = lambda x, m: np.pad(np.asarray(x, np.int64), (0, m - len(x)))
  n = max(len(r.item_ids) for r in requests) + max(ncand) + 1
  batch = DlrmBatch(offsets=offsets, num_candidates=pad(ncand, B),
                    user_ids=pad([r.user_id for r in requests], B), item_ids=tok(0),
                    category_ids=tok(1), action_weights=tok(2), timestamps=tok(3),
                    candidate_index=pad(np.concatenate(cand), C), n=np.asarray(n))
  return jax.tree.map(lambda x: np.asarray(x, np.int32), batch)
