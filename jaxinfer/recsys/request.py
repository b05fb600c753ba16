"""One DLRMv3 request as MLPerf's reference builds it: a user's history and candidates.

The reference's data set (`recommendation/dlrm_v3/datasets/synthetic_streaming.py`,
`load_item`) turns a user's CSV row into two KeyedJaggedTensors; `DlrmRequest`
holds the same features, one array each, before any packing:

  history (the "uih" features, n events): item_id, item_rating, action_timestamp,
    item_weights (the action bitmask: action_weights[int(rating) - 1]; the
    generator's ratings are floats in [1, 5], e.g. 4.25),
    item_category_id (item_id // items_per_category)
  contextual: user_id (one id)
  candidates (c items): item_candidate_id, item_candidate_category_id,
    item_query_time (the history's latest timestamp, 0 without history),
    item_candidate_rating; the label of the one task, "rating", is
    bitwise_and(item_action_weights, 1) > 0, i.e. rating >= 3.5.

`validate` checks one request against the model's tables and limits and
raises ValueError naming the request's user, the field and the table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The reference's `configs.py`: action_weights = [1, 2, 4, 8, 16] (ratings 1..5).
ACTION_WEIGHTS = (1, 2, 4, 8, 16)


def _ints(x, name: str, user_id) -> np.ndarray:
  a = np.asarray(x)
  if a.size == 0:
    return np.zeros((0,), np.int64)
  if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"request of user {user_id}: {name} must be a 1-D integer array, got "
                     f"shape {a.shape} dtype {a.dtype}")
  return a.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class DlrmRequest:
  """One user's request (module docstring); arrays are int64, 1-D."""
  user_id: int
  item_ids: np.ndarray  # [n] history items
  ratings: np.ndarray  # [n] history ratings, floats in [1, 5] (int(r) picks the action)
  timestamps: np.ndarray  # [n] history action timestamps
  category_ids: np.ndarray  # [n]
  candidate_ids: np.ndarray  # [c]
  candidate_category_ids: np.ndarray  # [c]
  query_time: int
  candidate_ratings: np.ndarray | None = None  # [c]; labels: rating >= 3.5

  def __post_init__(self):
    u = self.user_id
    for f in ("item_ids", "timestamps", "category_ids", "candidate_ids",
              "candidate_category_ids"):
      object.__setattr__(self, f, _ints(getattr(self, f), f, u))
    object.__setattr__(self, "ratings", np.asarray(self.ratings, np.float64).reshape(-1))
    n, c = len(self.item_ids), len(self.candidate_ids)
    for f in ("ratings", "timestamps", "category_ids"):
      if len(getattr(self, f)) != n:
        raise ValueError(f"request of user {u}: {f} has {len(getattr(self, f))} entries, "
                         f"item_ids {n}")
    if len(self.candidate_category_ids) != c:
      raise ValueError(f"request of user {u}: candidate_category_ids has "
                       f"{len(self.candidate_category_ids)} entries, candidate_ids {c}")
    if self.candidate_ratings is not None:
      r = np.asarray(self.candidate_ratings, np.float64)
      if r.shape != (c,):
        raise ValueError(f"request of user {u}: candidate_ratings has shape {r.shape}, "
                         f"expected ({c},)")
      object.__setattr__(self, "candidate_ratings", r)
    if n and not (np.all(np.isfinite(self.ratings)) and self.ratings.min() >= 1
                  and self.ratings.max() < len(ACTION_WEIGHTS) + 1):
      raise ValueError(f"request of user {u}: ratings must be finite, in [1, "
                       f"{len(ACTION_WEIGHTS) + 1}), got {self.ratings.min()}..{self.ratings.max()}")

  @property
  def action_weights(self) -> np.ndarray:
    """The history's item_weights: the action bitmask of each event's rating."""
    return np.asarray(ACTION_WEIGHTS, np.int64)[self.ratings.astype(np.int64) - 1]

  @property
  def labels(self) -> np.ndarray:
    """The "rating" task's labels: candidate rating >= 3.5 (float32 [c])."""
    if self.candidate_ratings is None:
      raise ValueError(f"request of user {self.user_id} has no candidate_ratings (no labels)")
    return (self.candidate_ratings >= 3.5).astype(np.float32)

  @property
  def num_tokens(self) -> int:
    """Tokens in the STU stack: the contextual user_id token, history, candidates."""
    return 1 + len(self.item_ids) + len(self.candidate_ids)
