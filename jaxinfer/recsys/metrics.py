"""DLRMv3's quality metrics on the host: NE, AUC, accuracy (float64 NumPy).

  NE       normalized entropy: the mean log loss over the entropy of the labels'
           base rate p_bar, LL / -(p_bar ln p_bar + (1 - p_bar) ln(1 - p_bar));
           lower is better (1.0: no better than predicting the CTR)
  AUC      area under the ROC curve: the probability that a random positive
           scores above a random negative (ties count 1/2), from ranks
  accuracy the fraction of (sigmoid(logit) > 0.5) == label

MLPerf v6.0's DLRMv3 targets (`MLPERF_TARGETS`) are the reference model's
NE 86.687%, accuracy 69.651% and AUC 78.663%, each to be met to 99.9%
(`meets_targets`; NE, lower-better, within 1/0.999 of its target).
"""

from __future__ import annotations

import numpy as np

MLPERF_TARGETS = {"ne": 0.86687, "accuracy": 0.69651, "auc": 0.78663}
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
  """Fraction of (logit > 0, i.e. sigmoid > 0.5) equal to the label."""
  y, z = _check(labels, logits)
  return float(np.mean((z > 0) == (y == 1)))


def evaluate(labels, logits) -> dict:
  """{"ne", "auc", "accuracy"} of one set of scored candidates."""
  return {"ne": normalized_entropy(labels, logits), "auc": auc(labels, logits),
          "accuracy": accuracy(labels, logits)}


def meets_targets(m: dict, targets: dict = MLPERF_TARGETS) -> dict:
  """{metric: bool}: AUC and accuracy >= 99.9% of target, NE <= target / 0.999."""
  return {"ne": m["ne"] <= targets["ne"] / TARGET_FRACTION,
          "auc": m["auc"] >= targets["auc"] * TARGET_FRACTION,
          "accuracy": m["accuracy"] >= targets["accuracy"] * TARGET_FRACTION}
