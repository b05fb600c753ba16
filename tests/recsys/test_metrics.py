"""NE / AUC / accuracy against scikit-learn's on the same scores, including the
tiny model's scores on synthetic labels."""

import numpy as np
import pytest
from sklearn import metrics as skm

from jaxinfer.recsys import metrics


def _sk(labels, logits):
  p = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
  base = np.full_like(p, labels.mean())
  return {"ne": skm.log_loss(labels, p) / skm.log_loss(labels, base),
          "auc": skm.roc_auc_score(labels, logits),
          "accuracy": skm.accuracy_score(labels, p >= 0.5)}  # torchrec's threshold: >= 0.5


@pytest.mark.parametrize("seed,n,ties", [(0, 1000, False), (1, 37, True), (2, 5000, True)])
def test_metrics_equal_scikit_learn(seed, n, ties):
  r = np.random.default_rng(seed)
  z = r.standard_normal(n) * 2
  if ties:
    z = np.round(z, 1)  # many tied scores: AUC's 1/2 per tie
  y = (r.random(n) < 1 / (1 + np.exp(-z + 0.3))).astype(np.int32)
  got, want = metrics.evaluate(y, z), _sk(y, z)
  for k in want:
    assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
  assert 0.5 < got["auc"] < 1 and got["ne"] < 1  # informative scores beat the base rate


@pytest.mark.parametrize("labels,logits,match", [
    ([0, 1], [0.1], "one length"),
    ([0, 2], [0.1, 0.2], "labels must be 0 or 1"),
    ([0, 1], [0.1, np.nan], "finite"),
    ([1, 1], [0.1, 0.2], "both labels"),
])
def test_bad_input_raises(labels, logits, match):
  with pytest.raises(ValueError, match=match):
    metrics.evaluate(np.asarray(labels), np.asarray(logits))
