"""DLRMv3's quality metrics on the host: NE, AUC, GAUC, accuracy (float64 NumPy).

  NE       normalized entropy: the mean log loss over the entropy of the labels'
           base rate p_bar, LL / -(p_bar ln p_bar + (1 - p_bar) ln(1 - p_bar));
           lower is better (1.0: no better than predicting the CTR)
  AUC      area under the ROC curve: the probability that a random positive
           scores above a random negative (ties count 1/2), from ranks
  GAUC     grouped AUC: each request's AUC over its own candidates, averaged
           unweighted over the requests that have an AUC (torchrec's
           GAUCMetricComputation skips requests whose labels are all 0 or all 1
           and requests whose predictions are all equal, or 0)
  accuracy the fraction of (sigmoid(logit) >= 0.5) == label

`evaluate` takes logits; `evaluate_probs` takes what MLPerf's accuracy log
holds (float32 probabilities, weights) and computes as torchrec does there:
NE with the probabilities clipped to [1e-12, 1 - 1e-12], weighted sums.
MLPerf v6.0's DLRMv3 targets (`MLPERF_TARGETS`) are the reference model's
NE 86.687%, accuracy 69.651% and "AUC" 78.663%, each to be met to 99.9%
(`meets_targets`; NE, lower-better, within 1/0.999 of its target). The
reference's accuracy.py computes only NE, accuracy and GAUC (its
MetricsLogger), so its "AUC" is the GAUC, and that is what `meets_targets`
judges; the pooled AUC is reported beside it.
"""

from __future__ import annotations

import numpy as np

MLPERF_TARGETS = {"ne": 0.86687, "accuracy": 0.69651, "gauc": 0.78663}
EPS = 1e-12  # torchrec NE's clip of the probabilities
TARGET_FRACTION = 0.999


def _check(labels, logits):
  y = np.asarray(labels)
  z = np.asarray(logits, np.float64)
  if y.ndim != 1 or z.shape != y.shape or y.size == 0:
    raise ValueError(f"labels and logits must be non-empty [n] arrays of one length, got "
                     f"{y.shape} and {z.shape}")
  if not np.all((y == 0) | (y == 1)):
    raise ValueError("labels must be 0 or 1")
  if not np.all(np.isfinite(z)):
    raise ValueError("logits must be finite")
  return y.astype(np.float64), z


def _log_sigmoid(z):
  return -np.logaddexp(0.0, -z)


def normalized_entropy(labels, logits) -> float:
  """Mean binary cross-entropy of sigmoid(logits) over the base rate's entropy."""
  y, z = _check(labels, logits)
  p_bar = y.mean()
  if p_bar in (0.0, 1.0):
    raise ValueError("normalized entropy needs both labels present (the base rate's entropy is 0)")
  ll = -np.mean(y * _log_sigmoid(z) + (1 - y) * _log_sigmoid(-z))
  return float(ll / -(p_bar * np.log(p_bar) + (1 - p_bar) * np.log(1 - p_bar)))


def _average_ranks(x):
  order = np.argsort(x, kind="mergesort")
  sx = x[order]
  ranks = np.empty(len(x))
  starts = np.flatnonzero(np.r_[True, sx[1:] != sx[:-1]])
  ends = np.r_[starts[1:], len(x)]
  avg = (starts + ends + 1) / 2.0  # 1-based ranks averaged over each tie run
  ranks[order] = np.repeat(avg, ends - starts)
  return ranks


def auc(labels, logits) -> float:
  """ROC AUC (Mann-Whitney U over average ranks)."""
  y, z = _check(labels, logits)
  pos = y.sum()
  neg = len(y) - pos
  if pos == 0 or neg == 0:
    raise ValueError("AUC needs both labels present")
  r = _average_ranks(z)
  return float((r[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def accuracy(labels, logits) -> float:
  """Fraction of (logit >= 0, i.e. sigmoid >= 0.5) equal to the label."""
  y, z = _check(labels, logits)
  return float(np.mean((z >= 0) == (y == 1)))


def _groups(n: int, num_candidates) -> np.ndarray:
  c = np.asarray(num_candidates)
  if c.ndim != 1 or not np.issubdtype(c.dtype, np.integer) or np.any(c < 1) or c.sum() != n:
    raise ValueError(f"num_candidates must be positive integers summing to the {n} scores, "
                     f"got {c.tolist()}")
  return np.r_[0, np.cumsum(c)]


def gauc(labels, scores, num_candidates, *, probabilities: bool = False) -> dict:
  """{"gauc", "groups"}: the mean AUC over the requests (consecutive runs of
  num_candidates[i] scores) that have one (module docstring); ties count 1/2.
  probabilities: scores are probabilities, and (as torchrec's mask, which takes
  0 for padding) a request whose scores all equal its first or 0 is skipped."""
  y, z = _check(labels, scores)
  bounds = _groups(len(y), num_candidates)
  aucs = []
  for a, b in zip(bounds[:-1], bounds[1:]):
    yy, zz = y[a:b], z[a:b]
    if yy.min() == yy.max() or np.all((zz == zz[0]) | (probabilities & (zz == 0))):
      continue
    aucs.append(auc(yy, zz))
  if not aucs:
    raise ValueError("GAUC needs a request with both labels and unequal scores")
  return {"gauc": float(np.mean(aucs)), "groups": len(aucs)}


def evaluate(labels, logits, num_candidates=None) -> dict:
  """{"ne", "auc", "accuracy"} of one set of scored candidates, and "gauc" /
  "gauc_groups" when num_candidates splits them into requests."""
  m = {"ne": normalized_entropy(labels, logits), "auc": auc(labels, logits),
       "accuracy": accuracy(labels, logits)}
  if num_candidates is not None:
    g = gauc(labels, logits, num_candidates)
    m.update(gauc=g["gauc"], gauc_groups=g["groups"])
  return m


def evaluate_probs(labels, probs, weights, num_candidates) -> dict:
  """`evaluate` on probabilities (MLPerf's accuracy log) as torchrec computes
  it: weighted NE of the clipped probabilities, weighted accuracy of
  (p >= 0.5), GAUC of the probabilities (unweighted), and the pooled AUC."""
  y, p = _check(labels, probs)
  w = np.asarray(weights, np.float64)
  if w.shape != y.shape or np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
    raise ValueError(f"weights must be a finite, non-negative [n] array with a positive sum, "
                     f"got shape {w.shape}")
  if np.any((p < 0) | (p > 1)):
    raise ValueError("probabilities must be in [0, 1]")
  q = np.clip(p, EPS, 1 - EPS)
  ce = -np.sum(w * (y * np.log(q) + (1 - y) * np.log1p(-q)))
  pos, neg = np.sum(w * y), np.sum(w * (1 - y))
  p_bar = np.clip(pos / (pos + neg), EPS, 1 - EPS)
  g = gauc(y, p, num_candidates, probabilities=True)
  return {"ne": float(ce / -(pos * np.log(p_bar) + neg * np.log1p(-p_bar))),
          "accuracy": float(np.sum(w * ((p >= 0.5) == (y == 1))) / w.sum()),
          "gauc": g["gauc"], "gauc_groups": g["groups"], "auc": auc(y, p)}


def meets_targets(m: dict, targets: dict = MLPERF_TARGETS) -> dict:
  """{metric: bool}: GAUC and accuracy >= 99.9% of target, NE <= target / 0.999."""
  return {"ne": m["ne"] <= targets["ne"] / TARGET_FRACTION,
          "gauc": m["gauc"] >= targets["gauc"] * TARGET_FRACTION,
          "accuracy": m["accuracy"] >= targets["accuracy"] * TARGET_FRACTION}
