"""An independent check of DLRMv3's accuracy log and metrics, written from
the MLPerf reference's reading of them (not from jaxinfer's code):

- mlcommons/inference recommendation/dlrm_v3/accuracy.py: each entry's hex
  `data` is float32 [ts_idx, query_idx, preds (n), labels (n), weights (n), n],
  n the last float, asserted to be 3n + 3 floats; each entry is one request.
- its utils.py MetricsLogger feeds torchrec's NE, Accuracy and GAUC
  computations (torchrec/metrics/{ne,accuracy,gauc}.py):
  NE = sum w CE(clip(p, 1e-12)) / (entropy of the weighted base rate, clipped),
  accuracy = sum w [(p >= 0.5) == y] / sum w,
  GAUC = mean over requests of the request's AUC, skipping requests whose
  labels are all 0 / all 1 and those whose predictions all equal the first
  (or are 0, torchrec's padding).

Here the per-request AUC is scikit-learn's roc_auc_score and NE is in bits.
"""

import json

import numpy as np
from sklearn.metrics import roc_auc_score


def parse(path):
  """The reference parser's loop -> [(preds, labels, weights)] per entry."""
  with open(path) as f:
    results = json.load(f)
  out = []
  for result in results:
    data = np.frombuffer(bytes.fromhex(result["data"]), np.float32)
    n = data[-1].astype(int)
    assert len(data) == 3 + n * 3
    out.append((data[2:2 + n], data[2 + n:2 + 2 * n], data[2 + 2 * n:2 + 3 * n]))
  return out


def metrics(requests):
  """{"ne", "accuracy", "gauc", "gauc_groups"} of [(preds, labels, weights)]."""
  p = np.concatenate([r[0] for r in requests]).astype(np.float64)
  y = np.concatenate([r[1] for r in requests]).astype(np.float64)
  w = np.concatenate([r[2] for r in requests]).astype(np.float64)
  q = np.clip(p, 1e-12, 1 - 1e-12)
  ce = np.sum(-w * y * np.log2(q) - w * (1 - y) * np.log2(1 - q))
  pos, neg = np.sum(w * y), np.sum(w * (1 - y))
  base = np.clip(pos / np.sum(w), 1e-12, 1 - 1e-12)
  ne = ce / (-pos * np.log2(base) - neg * np.log2(1 - base))
  acc = np.sum(w * ((p >= 0.5) == y)) / np.sum(w)
  aucs = []
  for preds, labels, _ in requests:
    if len(set(labels.tolist())) < 2:
      continue
    if all(v == preds[0] or v == 0 for v in preds.tolist()):
      continue
    aucs.append(roc_auc_score(labels, preds))
  return {"ne": ne, "accuracy": acc, "gauc": float(np.mean(aucs)), "gauc_groups": len(aucs)}


def write_log(path, records):
  """A LoadGen-shaped mlperf_log_accuracy.json of float32 records."""
  entries = [{"seq_id": i, "qsl_idx": int(r[1]), "data": np.asarray(r, "<f4").tobytes().hex()}
             for i, r in enumerate(records)]
  with open(path, "w") as f:
    json.dump(entries, f)
