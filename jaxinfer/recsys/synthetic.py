"""A synthetic streaming data set of DLRMv3's shape, with labels.

MLPerf's DLRMv3 data set is synthetic and streamed: 5M users over 1B items,
of which 1% are ever used, each request one user's history (item, action,
timestamp) plus candidates to score. Here user i is generated on demand from
(seed, i) alone, so any sample of a 5M-user set is reachable without storing
the set. Items follow a Zipf popularity over the used ones (spread over the
whole table: used item r is row r * (1 / item_fraction)); history lengths are
geometric around `mean_history`, capped at `max_history`.

Labels carry signal: each item has a hidden category (its row mod
`categories`); a candidate's click probability is
sigmoid(2 * [category is the user's most frequent history category] - 1
+ item popularity term), so a model that reads the history can beat the
base rate (a random model scores near AUC 0.5).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.recsys.batch import User
from jaxinfer.recsys.config import HSTUConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
  """The data set's shape (see the module docstring)."""
  num_users: int
  num_items: int
  item_fraction: float = 0.01
  mean_history: int = 16
  max_history: int = 48
  candidates: int = 4
  num_actions: int = 8
  feature_rows: tuple[int, ...] = (16,)
  categories: int = 7
  zipf: float = 1.05
  seed: int = 0

  def __post_init__(self):
    if not 0 < self.item_fraction <= 1:
      raise ValueError(f"item_fraction must be in (0, 1], got {self.item_fraction}")
    for f in ("num_users", "num_items", "mean_history", "max_history", "candidates"):
      if getattr(self, f) < 1:
        raise ValueError(f"SyntheticSpec.{f} must be >= 1, got {getattr(self, f)}")

  @property
  def used_items(self) -> int:
    return max(1, int(self.num_items * self.item_fraction))


def for_model(cfg: HSTUConfig, *, num_users: int, item_fraction: float = 0.01, seed: int = 0,
              candidates: int | None = None) -> SyntheticSpec:
  """A spec whose requests fit `cfg` (tables and max_seq_len): DLRMv3's shape
  for the `hstu_paper` preset (5M users, 1% of 1B items), a small one for tiny."""
  cand = candidates or max(1, min(64, cfg.max_seq_len // 16))
  max_hist = cfg.max_seq_len - 1 - cand
  return SyntheticSpec(num_users=num_users, num_items=cfg.num_items, item_fraction=item_fraction,
                       mean_history=max(1, max_hist // 3), max_history=max_hist,
                       candidates=cand, num_actions=cfg.num_actions,
                       feature_rows=cfg.user_feature_rows, seed=seed)


def _items(spec: SyntheticSpec, rng, n: int) -> np.ndarray:
  # Zipf ranks folded into the used items, then spread over the table's rows.
  rank = (rng.zipf(spec.zipf, n) - 1) % spec.used_items
  return rank * (spec.num_items // spec.used_items)


def sample(spec: SyntheticSpec, i: int) -> tuple[User, np.ndarray]:
  """User i (0 <= i < num_users) and its candidates' 0/1 labels."""
  if not 0 <= i < spec.num_users:
    raise ValueError(f"user index must be in [0, {spec.num_users}), got {i}")
  rng = np.random.default_rng([spec.seed, i])
  n = int(min(spec.max_history, 1 + rng.geometric(1.0 / spec.mean_history)))
  items = _items(spec, rng, n)
  times = 1_600_000_000 + np.cumsum(rng.integers(1, 86_400, n))
  cands = _items(spec, rng, spec.candidates)
  cats = items % spec.categories
  favourite = np.bincount(cats, minlength=spec.categories).argmax()
  rank = cands // (spec.num_items // spec.used_items)
  affinity = 2.0 * (cands % spec.categories == favourite) - 1.0 + 0.5 / (1.0 + np.log1p(rank))
  labels = (rng.random(spec.candidates) < 1 / (1 + np.exp(-affinity))).astype(np.int32)
  user = User(items=items.tolist(), actions=rng.integers(1, spec.num_actions, n).tolist(),
              timestamps=times.tolist(),
              features=[rng.integers(0, r, rng.integers(1, 4)).tolist() for r in spec.feature_rows],
              candidates=cands.tolist(), query_time=int(times[-1] + rng.integers(1, 3600)))
  return user, labels
