"""DLRMv3's accuracy log and metrics as MLPerf reads them: our records parsed
by a port of the reference's accuracy.py, and NE / accuracy / GAUC equal to an
independent computation (scikit-learn's AUC per request, NumPy NE in bits;
tests/recsys/mlperf_accuracy_reference.py)."""

import json

import numpy as np
import pytest
from sklearn import metrics as skm

from jaxinfer.recsys import metrics
from jaxinfer.serving import dlrm
import mlperf_accuracy_reference as ref


def _requests(seed):
  """Requests of 1-12 candidates, among them all-positive, all-negative,
  identical-score and tied ones, and a skewed weight per candidate."""
  r = np.random.default_rng(seed)
  out = []
  for k in range(60):
    n = int(r.integers(1, 13))
    z = r.standard_normal(n) * 2
    y = (r.random(n) < 1 / (1 + np.exp(-z + 0.3))).astype(np.int32)
    if k % 10 == 1:
      y[:] = 1
    elif k % 10 == 2:
      y[:] = 0
    elif k % 10 == 3:
      z[:] = 0.7  # identical scores: no AUC
    elif k % 10 == 4:
      z = np.round(z)  # ties: 1/2 each
    out.append((z, y))
  return out


@pytest.mark.parametrize("seed", [0, 1])
def test_gauc_ne_accuracy_equal_the_independent_computation(seed):
  reqs = _requests(seed)
  recs = [dlrm.accuracy_record(i, z, y) for i, (z, y) in enumerate(reqs)]
  ref_reqs = [(rec[2:2 + len(z)], rec[2 + len(z):2 + 2 * len(z)],
               np.random.default_rng(i).uniform(0.5, 2, len(z)).astype(np.float32))
              for i, (rec, (z, _)) in enumerate(zip(recs, reqs))]
  want = ref.metrics(ref_reqs)
  cat = lambda j: np.concatenate([q[j] for q in ref_reqs])
  got = metrics.evaluate_probs(cat(1), cat(0), cat(2), [len(q[0]) for q in ref_reqs])
  for k in ("ne", "accuracy", "gauc"):
    assert got[k] == pytest.approx(want[k], rel=1e-9), k
  assert got["gauc_groups"] == want["gauc_groups"]
  skipped = sum(1 for z, y in reqs if y.min() == y.max() or np.all(z == z[0]))
  assert want["gauc_groups"] == len(reqs) - skipped and skipped >= 12
  assert got["auc"] == pytest.approx(skm.roc_auc_score(cat(1), cat(0)), rel=1e-9)
  # On logits the GAUC is the same (AUC is rank-based; sigmoid keeps the order here).
  z, y = np.concatenate([q[0] for q in reqs]), np.concatenate([q[1] for q in reqs])
  m = metrics.evaluate(y, z, num_candidates=[len(q[0]) for q in reqs])
  assert m["gauc"] == pytest.approx(want["gauc"], rel=1e-9)


def test_gauc_weights_requests_equally_and_skips_torchrec_padding_zeros():
  # Request A (AUC 1.0, 2 candidates), B (AUC 0.0, 4 candidates): unweighted mean 0.5.
  y = np.array([1, 0, 0, 0, 1, 1])
  p = np.array([0.9, 0.1, 0.8, 0.7, 0.2, 0.1])
  assert metrics.gauc(y, p, [2, 4]) == {"gauc": 0.5, "groups": 2}
  # Scores that all equal the first or 0 are torchrec's "identical" request.
  assert metrics.gauc([1, 0, 1, 0], [0.3, 0.0, 0.6, 0.4], [2, 2], probabilities=True) == {
      "gauc": 1.0, "groups": 1}
  assert metrics.gauc([1, 0], [0.3, 0.0], [2])["groups"] == 1  # logits: 0 is a score
  with pytest.raises(ValueError, match="num_candidates"):
    metrics.gauc(y, p, [2, 3])
  with pytest.raises(ValueError, match="GAUC needs"):
    metrics.gauc([1, 1, 0], [0.1, 0.2, 0.3], [2, 1])


def test_our_log_round_trips_through_the_reference_parser(tmp_path):
  reqs = _requests(2)
  recs = [dlrm.accuracy_record(i, z, y) for i, (z, y) in enumerate(reqs)]
  path = str(tmp_path / "mlperf_log_accuracy.json")
  ref.write_log(path, recs)
  theirs, ours = ref.parse(path), dlrm.parse_accuracy_log(path)
  assert len(theirs) == len(ours) == len(reqs)
  for i, ((p, y, w), o, (z, yy)) in enumerate(zip(theirs, ours, reqs)):
    assert o["qsl_idx"] == o["query_idx"] == i and o["ts_idx"] == -1
    np.testing.assert_array_equal(y, yy)
    np.testing.assert_array_equal(w, 1.0)
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-z)), rtol=1e-6)
    for a, b in zip((p, y, w), (o["preds"], o["labels"], o["weights"])):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="2 labels for 3 candidates"):
    dlrm.accuracy_record(0, [0.1, 0.2, 0.3], [0, 1])
  with open(path, "w") as f:  # a logits-only (performance-mode) response is not a record
    json.dump([{"seq_id": 0, "qsl_idx": 0, "data": np.ones(4, "<f4").tobytes().hex()}], f)
  with pytest.raises(ValueError, match="not an accuracy record"):
    dlrm.parse_accuracy_log(path)


def test_targets_judge_gauc_ne_accuracy_at_99_9_percent():
  t = metrics.MLPERF_TARGETS
  assert t == {"ne": 0.86687, "accuracy": 0.69651, "gauc": 0.78663}
  assert all(metrics.meets_targets(t).values())
  worse = {"ne": t["ne"] / 0.998, "gauc": t["gauc"] * 0.998, "accuracy": t["accuracy"] * 0.998}
  assert not any(metrics.meets_targets(worse).values())
