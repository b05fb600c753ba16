"""Jagged user sequences packed into one token axis (no padding to the longest user).

A request is one user: a history of (item, action, timestamp) events, the
user's sparse features (one bag of ids per user-feature table) and the
candidate items to score at `query_time`. `pack` lays a batch of users out as

  user u's tokens  [offsets[u], offsets[u + 1]) = ctx, history..., candidates...

one contextual token (the user's pooled sparse features), then the history,
then the candidates (num_targets[u] of them; action 0 = unknown, timestamp
= query_time). Tokens past offsets[B] are padding (a token bucket), and so are
users past the real ones (empty, a batch bucket) and candidate slots past the
real ones (target_index 0, scores dropped by the caller).

`JaggedBatch` is a pytree of int32 arrays (jit takes it whole; its shapes are
the buckets); `validate` checks one on the host and raises ValueError naming
the field.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jaxinfer.recsys.config import HSTUConfig


@dataclasses.dataclass(frozen=True)
class User:
  """One request: history events, sparse-feature bags, candidates."""
  items: Sequence[int]
  actions: Sequence[int]
  timestamps: Sequence[int]
  features: Sequence[Sequence[int]]  # one bag of ids per user-feature table
  candidates: Sequence[int]
  query_time: int

  @property
  def num_tokens(self) -> int:
    return 1 + len(self.items) + len(self.candidates)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class JaggedBatch:
  """Packed tokens (T), users (B), candidates (C), feature ids (Nf per table)."""
  offsets: jax.Array  # [B + 1] token offsets per user
  num_targets: jax.Array  # [B] candidates per user (its last tokens)
  item_ids: jax.Array  # [T] (the contextual and padding tokens: 0)
  action_ids: jax.Array  # [T]
  timestamps: jax.Array  # [T] seconds
  target_index: jax.Array  # [C] token index of each candidate
  feature_ids: tuple  # per user-feature table: [Nf] ids
  feature_offsets: tuple  # per user-feature table: [B + 1] bag offsets

  @property
  def num_tokens(self) -> int:
    return int(self.item_ids.shape[0])


def _bucket(n: int, bucket: int | None) -> int:
  if bucket is None:
    return max(n, 1)
  if bucket < n:
    raise ValueError(f"bucket {bucket} is smaller than the {n} entries to pack")
  return bucket


def _users_arrays(users: Sequence[User]):
  ctx_hist = [[0, *u.items] for u in users]
  items = [np.asarray([*h, *u.candidates], np.int64) for h, u in zip(ctx_hist, users)]
  actions = [np.asarray([0, *u.actions, *([0] * len(u.candidates))], np.int64) for u in users]
  first = [u.timestamps[0] if len(u.timestamps) else u.query_time for u in users]
  times = [np.asarray([f, *u.timestamps, *([u.query_time] * len(u.candidates))], np.int64)
           for f, u in zip(first, users)]
  for u in users:
    if not len(u.items) == len(u.actions) == len(u.timestamps):
      raise ValueError(f"user history: items, actions and timestamps differ in length "
                       f"({len(u.items)}, {len(u.actions)}, {len(u.timestamps)})")
  return items, actions, times


def _check_users(cfg: HSTUConfig, users: Sequence[User]) -> None:
  """Per user, naming the user, field and table: one feature bag per
  user-feature table, every id in its table's range."""
  tables = len(cfg.user_feature_rows)
  for k, u in enumerate(users):
    if len(u.features) != tables:
      raise ValueError(f"user {k}: features has {len(u.features)} bags, the model has {tables} "
                       f"user-feature tables (user_0..user_{tables - 1}): one bag per table")
    fields = [("items", u.items, "items", cfg.num_items),
              ("candidates", u.candidates, "items", cfg.num_items),
              ("actions", u.actions, "actions", cfg.num_actions)]
    fields += [(f"features[{f}]", bag, f"user_{f}", r)
               for f, (bag, r) in enumerate(zip(u.features, cfg.user_feature_rows))]
    for field, ids, table, rows in fields:
      ids = np.asarray(ids)
      if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1):
        raise ValueError(f"user {k}: {field} must be a flat list of integer ids")
      if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise ValueError(f"user {k}: {field} has ids out of table {table!r}'s range "
                         f"[0, {rows}): min {ids.min()}, max {ids.max()}")


def pack(cfg: HSTUConfig, users: Sequence[User], *, token_bucket: int | None = None,
         user_bucket: int | None = None, target_bucket: int | None = None,
         feature_bucket: int | None = None) -> JaggedBatch:
  """Users -> a validated `JaggedBatch`, padded to the given buckets (module
  docstring); raises ValueError naming the user, field and table of bad input."""
  if not users:
    raise ValueError("pack needs at least one user")
  _check_users(cfg, users)
  items, actions, times = _users_arrays(users)
  lengths = [len(x) for x in items]
  T, B = _bucket(sum(lengths), token_bucket), _bucket(len(users), user_bucket)
  offsets = np.zeros(B + 1, np.int64)
  offsets[1:len(users) + 1] = np.cumsum(lengths)
  offsets[len(users) + 1:] = offsets[len(users)]
  num_targets = np.zeros(B, np.int64)
  num_targets[:len(users)] = [len(u.candidates) for u in users]
  targets = np.concatenate([offsets[u] + lengths[u] - num_targets[u] + np.arange(num_targets[u])
                            for u in range(len(users))])
  if target_bucket is not None and len(targets) > target_bucket:
    raise ValueError(f"candidates: {len(targets)} in this batch, over the candidate limit "
                     f"(target_bucket) {target_bucket}")
  C = _bucket(len(targets), target_bucket)
  tok = lambda parts: np.pad(np.concatenate(parts), (0, T - sum(lengths)))
  feat_ids, feat_offsets = [], []
  for f in range(len(cfg.user_feature_rows)):
    bags = [list(u.features[f]) for u in users]
    n = sum(len(b) for b in bags)
    ids = np.zeros(_bucket(n, feature_bucket), np.int64)
    ids[:n] = [i for b in bags for i in b]
    offs = np.zeros(B + 1, np.int64)
    offs[1:len(users) + 1] = np.cumsum([len(b) for b in bags])
    offs[len(users) + 1:] = n
    feat_ids.append(ids)
    feat_offsets.append(offs)
  batch = JaggedBatch(offsets=offsets, num_targets=num_targets, item_ids=tok(items),
                      action_ids=tok(actions), timestamps=tok(times),
                      target_index=np.pad(targets, (0, C - len(targets))),
                      feature_ids=tuple(feat_ids), feature_offsets=tuple(feat_offsets))
  validate(cfg, batch)
  return jax.tree.map(lambda x: np.asarray(x, np.int32), batch)


def _ints(name: str, x, ndim: int) -> np.ndarray:
  x = np.asarray(x)
  if not np.issubdtype(x.dtype, np.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
  if x.ndim != ndim:
    raise ValueError(f"{name} must have rank {ndim}, got shape {x.shape}")
  return x.astype(np.int64)


def _check_offsets(name: str, offs: np.ndarray, total: int) -> None:
  if offs.shape[0] < 2 or offs[0] != 0 or np.any(np.diff(offs) < 0) or offs[-1] > total:
    raise ValueError(f"{name} must start at 0 and be non-decreasing (monotone) up to at most "
                     f"{total}, got {offs.tolist()}")


def _check_ids(name: str, ids: np.ndarray, rows: int) -> None:
  if ids.size and (ids.min() < 0 or ids.max() >= rows):
    raise ValueError(f"{name} out of table range [0, {rows}): min {ids.min()}, max {ids.max()}")


def validate(cfg: HSTUConfig, batch: JaggedBatch) -> None:
  """Host check of a batch (integer dtypes, monotone offsets, lengths, ids in
  table range); raises ValueError naming the problem."""
  offs = _ints("offsets", batch.offsets, 1)
  B = offs.shape[0] - 1
  item_ids = _ints("item_ids", batch.item_ids, 1)
  T = item_ids.shape[0]
  for name in ("action_ids", "timestamps"):
    if _ints(name, getattr(batch, name), 1).shape != (T,):
      raise ValueError(f"{name} must have shape ({T},) like item_ids")
  _check_offsets("offsets", offs, T)
  lengths = np.diff(offs)
  if lengths.max(initial=0) > cfg.max_seq_len:
    raise ValueError(f"a user has {lengths.max()} tokens, over max_seq_len {cfg.max_seq_len}")
  nt = _ints("num_targets", batch.num_targets, 1)
  if nt.shape != (B,) or np.any(nt < 0) or np.any(nt > np.maximum(lengths - 1, 0)):
    raise ValueError(f"num_targets must be [B={B}] with 0 <= num_targets < user length "
                     f"(a contextual token first), got {nt.tolist()}")
  _check_ids("item_ids", item_ids, cfg.num_items)
  _check_ids("action_ids", _ints("action_ids", batch.action_ids, 1), cfg.num_actions)
  _check_ids("target_index", _ints("target_index", batch.target_index, 1), max(T, 1))
  if len(batch.feature_ids) != len(cfg.user_feature_rows) or len(batch.feature_offsets) != len(
      cfg.user_feature_rows):
    raise ValueError(f"feature_ids / feature_offsets need one entry per user-feature table "
                     f"({len(cfg.user_feature_rows)})")
  for f, rows in enumerate(cfg.user_feature_rows):
    ids = _ints(f"feature_ids[{f}]", batch.feature_ids[f], 1)
    fo = _ints(f"feature_offsets[{f}]", batch.feature_offsets[f], 1)
    if fo.shape != (B + 1,):
      raise ValueError(f"feature_offsets[{f}] must have shape ({B + 1},), got {fo.shape}")
    _check_offsets(f"feature_offsets[{f}]", fo, ids.shape[0])
    _check_ids(f"feature_ids[{f}]", ids, rows)
