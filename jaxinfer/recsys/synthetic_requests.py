"""DLRMv3 requests drawn as MLPerf's streaming synthetic generator draws them.

MLPerf's data set (`recommendation/dlrm_v3/streaming_synthetic_data.py`,
`StreamingSyntheticDataGenerator`, run with 5M users, 1B items, 128 categories,
4 categories a user, 100 timestamps, 50 samples an item, 2,048 inference
candidates, train ratio 0.9, user sampling ratio 0.7) writes CSV files that
`recsys.streaming` reads. This module draws a user's inference request from
the same distributions on demand, from (seed, user, ts) alone, so LoadGen runs
and tests need no files and any scale is reachable:

- a user likes `categories_per_user` categories; each slot's items pick a
  liked category by a Polya urn (weight alpha / k + the category's count so
  far, alpha uniform in 1..500), then an item uniform over the first
  (t + 1) / num_timestamps of that category's items;
- an item's rating is the mean of its category's draw (the user's first
  quarter of categories rate ~4.5, the next ~4, then ~3, then ~2, each with
  the generator's cos(t pi / 4) drift) and the item's own rating (5 / 4 / 3 /
  2 / 1 with probabilities .2 / .25 / .25 / .2 / .1, fixed per item);
- slot lengths are Gaussian around num_items * samples_per_item / num_users /
  num_timestamps (sd a quarter of it, at least 33 events);
- the history at inference timestamp ts is the base slot, each training slot
  the user was sampled in (probability user_sampling_ratio) and each earlier
  inference slot; the candidates are the ts slot's items (the generator's
  num_inference_candidates), the history keeps its first max_uih_len events
  (the reference's `maybe_truncate_seq` keeps y[:max_len]). Timestamps are 1 and query time 1, as the reference's reader sets.

The draws follow the generator's distributions, not its random stream: the
files MLPerf publishes are read by `recsys.streaming`, not reproduced here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxinfer.recsys.request import DlrmRequest

_ITEM_RATINGS = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
_ITEM_RATING_P = np.array([0.2, 0.25, 0.25, 0.2, 0.1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestSpec:
  """The generator's settings (defaults: MLPerf's `main()` but scaled by the caller)."""
  num_users: int = 5_000_000
  num_items: int = 1_000_000_000
  num_categories: int = 128
  categories_per_user: int = 4
  num_timestamps: int = 100
  samples_per_item: int = 50
  num_candidates: int = 2048
  train_ratio: float = 0.9
  user_sampling_ratio: float = 0.7
  max_uih_len: int = 14_335  # the reference reader: max_seq_len 16,384 - 2,048 candidates - 1
  seed: int = 0

  def __post_init__(self):
    if self.num_items < self.num_categories:
      raise ValueError(f"RequestSpec: num_items {self.num_items} < num_categories "
                       f"{self.num_categories}")
    if not 1 <= self.categories_per_user <= self.num_categories:
      raise ValueError(f"RequestSpec.categories_per_user must be in 1..num_categories, got "
                       f"{self.categories_per_user}")

  @property
  def items_per_category(self) -> int:
    return self.num_items // self.num_categories

  @property
  def mean_slot(self) -> int:
    return max(1, self.num_items * self.samples_per_item // self.num_users // self.num_timestamps)

  @property
  def train_ts(self) -> int:
    return int(self.num_timestamps * self.train_ratio)


def _item_rating(spec: RequestSpec, items: np.ndarray) -> np.ndarray:
  """Each item's fixed rating, a function of (seed, item) alone."""
  u = np.array([np.random.default_rng((spec.seed, 1, int(i))).random() for i in items])
  return _ITEM_RATINGS[np.searchsorted(np.cumsum(_ITEM_RATING_P), u, side="right").clip(0, 4)]


def _slot(spec: RequestSpec, rng, cats, counts, t: int, n: int):
  """n events of slot t: (items, ratings), counts updated (the Polya urn)."""
  alpha = rng.integers(1, 501)
  p = (alpha / len(cats) + counts) / (alpha + counts.sum())
  pick = rng.choice(len(cats), size=n, p=p / p.sum())
  np.add.at(counts, pick, 1)
  end = max(1, int(spec.items_per_category * max(t + 1, 1) / spec.num_timestamps))
  items = rng.integers(0, end, size=n) + cats[pick] * spec.items_per_category
  c = [math.cos(t * math.pi / 4), math.cos((t + 2) * math.pi / 4), math.cos((t + 4) * math.pi / 4)]
  base = np.array([[4.5 + .5 * c[0], 4.0 + .5 * c[1], 4.0 + .5 * c[1]],
                   [4.5 + .5 * c[0], 4.0 + .5 * c[1], 3.5 + .5 * c[2]],
                   [3.5 + .5 * c[0], 3.0 + .5 * c[1], 2.5 + .5 * c[2]],
                   [2.5 + .5 * c[0], 2.0 + .5 * c[1], 1.5 + .5 * c[2]]])
  probs = np.array([[.8, .2, 0.], [.1, .8, .1], [.1, .8, .1], [.1, .8, .1]])
  k = len(cats)
  quarter = np.select([pick < k // 4, pick < k // 2, pick < k // 4 * 3], [0, 1, 2], 3)
  which = np.array([rng.choice(3, p=probs[q]) for q in quarter], np.int64)
  cat_rating = base[quarter, which]
  return items.astype(np.int64), (cat_rating + _item_rating(spec, items)) / 2


def request(spec: RequestSpec, user: int, ts: int | None = None) -> DlrmRequest:
  """User `user`'s inference request at timestamp ts (default the first inference one)."""
  ts = spec.train_ts if ts is None else ts
  if not 0 <= user < spec.num_users:
    raise ValueError(f"user {user} out of range 0..{spec.num_users - 1}")
  if not spec.train_ts <= ts < spec.num_timestamps:
    raise ValueError(f"ts {ts}: inference timestamps are {spec.train_ts}..{spec.num_timestamps - 1}")
  rng = np.random.default_rng((spec.seed, 0, user))
  cats = rng.choice(spec.num_categories, size=spec.categories_per_user, replace=False)
  counts = np.zeros(len(cats))
  seq_len = lambda: max(33, round(rng.normal(spec.mean_slot, spec.mean_slot // 4)))
  hist_i, hist_r = [], []
  for t in [-1, *range(spec.train_ts), *range(spec.train_ts, ts)]:
    if t == -1 or rng.random() < spec.user_sampling_ratio:
      i, r = _slot(spec, rng, cats, counts, t, seq_len())
      hist_i.append(i), hist_r.append(r)
  cand, cand_r = _slot(spec, rng, cats, counts, ts, spec.num_candidates)
  items = np.concatenate(hist_i)[:spec.max_uih_len]
  ratings = np.concatenate(hist_r)[:spec.max_uih_len]
  ipc = spec.items_per_category
  return DlrmRequest(user_id=user, item_ids=items, ratings=ratings,
                     timestamps=np.ones(len(items), np.int64), category_ids=items // ipc,
                     candidate_ids=cand, candidate_category_ids=cand // ipc, query_time=1,
                     candidate_ratings=cand_r)


def for_model(cfg, *, seed: int = 0, **overrides) -> RequestSpec:
  """A spec whose requests fit a `DlrmV3Config`: its item, category and user
  rows (users at most MLPerf's 5M), its candidates per request, and histories
  that fill its max_seq_len (max_seq_len - candidates - 1, as the reference's
  reader truncates)."""
  fields = dict(num_users=min(cfg.user_rows, 5_000_000), num_items=cfg.item_rows,
                num_categories=cfg.category_rows, num_candidates=cfg.max_num_candidates,
                max_uih_len=cfg.max_seq_len - cfg.max_num_candidates - 1, seed=seed)
  if cfg.item_rows < 10**8:  # small models: fewer timestamps, shorter slots, and half
    fields.update(num_timestamps=10, samples_per_item=1, train_ratio=0.5)  # of them inference
  return RequestSpec(**{**fields, **overrides})


def samples(spec: RequestSpec, n: int) -> list[DlrmRequest]:
  """n distinct requests spread over the users: sample k is user (k * stride) mod
  num_users at the inference timestamp train_ts + k // num_users (a user asks
  again at a later timestamp once every user has asked), as MLPerf's query
  set holds each timestamp's sampled users."""
  inference = spec.num_timestamps - spec.train_ts
  if n > spec.num_users * inference:
    raise ValueError(f"samples: {n} requests, but {spec.num_users} users x {inference} "
                     f"inference timestamps hold only {spec.num_users * inference}")
  stride = max(1, spec.num_users // n)
  return [request(spec, (k * stride) % spec.num_users, spec.train_ts + k // spec.num_users)
          for k in range(n)]
