"""DLRMv3 serving: a batcher that packs jagged requests up to a token budget,
and a LoadGen system under test over it (`mlperf.run_loadgen`, query
latencies: Server's p99 limit is 80 ms).

  scorer = Scorer(cfg, params, Buckets.for_samples(cfg, requests, token_budget=512,
                                                   max_users=16))
  sut = DlrmSUT(scorer, requests)
  summary = mlperf.run_loadgen(sut, scenario="Server", latency_ms=80, target_qps=..., outdir=...)

The model is either recommender of `recsys.family` (DLRMv3 as MLPerf runs
it, `DlrmV3Config`, whose requests are `recsys.request.DlrmRequest`s; or the
paper-era HSTU, `HSTUConfig`, whose requests are `recsys.batch.User`s). A
request is one user; its response is the float32 logits of its candidates (in accuracy mode, a record: below). The batcher takes queued requests in arrival order
while their tokens fit the budget (and the user slots last), packs them into
one token axis (the family's `pack`) at fixed buckets, so every batch runs
one compiled program, scores them and answers each query. The SUT keeps the
scores it sent (`scores`); `accuracy_run` scores every sample once in
LoadGen's accuracy mode and computes NE / GAUC / accuracy / AUC
(`recsys.metrics.evaluate_probs`) from the records LoadGen logged.

In accuracy mode (the SUT holds `record_labels`) a response is the MLPerf
reference's record,
float32 [ts_idx, query_idx, probabilities (n), labels (n), weights (n), n]
(ts_idx -1: the synthetic data has no timestamp split; query_idx the sample
index; weights 1), which the reference's accuracy.py and `parse_accuracy_log`
read.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import time
from typing import Sequence

import jax
import numpy as np

from jaxinfer.recsys import family, metrics, synthetic, synthetic_requests
from jaxinfer.serving import mlperf


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buckets:
  """A batch's fixed shapes: tokens (the budget), users, candidates, ids per
  user-feature table (the paper-era HSTU's bags; DLRMv3 has none)."""
  token_budget: int
  max_users: int
  max_targets: int
  max_feature_ids: int = 1

  @classmethod
  def for_samples(cls, cfg, samples: Sequence, *, token_budget: int, max_users: int):
    """Buckets that hold any max_users of `samples` (requests of cfg's model)."""
    cand = max(family.of(cfg).num_candidates(u) for u in samples)
    feats = max((len(bag) for u in samples for bag in getattr(u, "features", ())), default=1)
    return cls(token_budget=token_budget, max_users=max_users, max_targets=max_users * cand,
               max_feature_ids=max(1, max_users * feats))


def take_batch(pending: collections.deque, sizes: Sequence[int], *, token_budget: int,
               max_users: int) -> list:
  """Pops (query id, sample index) pairs off `pending` in order while the samples'
  tokens (`sizes[index]`) fit `token_budget` and fewer than max_users are taken."""
  out, used = [], 0
  while pending and len(out) < max_users and used + sizes[pending[0][1]] <= token_budget:
    used += sizes[pending[0][1]]
    out.append(pending.popleft())
  return out


class Scorer:
  """Scores lists of users with one jitted program at `buckets`' shapes."""

  def __init__(self, cfg, params, buckets: Buckets):
    self.cfg, self.params, self.buckets = cfg, params, buckets
    self.family = family.of(cfg)
    score = self.family.score
    self._fn = jax.jit(lambda p, b: score(cfg, p, b))

  def __call__(self, users: Sequence) -> list[np.ndarray]:
    """Per user, its candidates' logits (float32)."""
    b = self.buckets
    batch = self.family.pack(self.cfg, users, tokens=b.token_budget, users=b.max_users,
                             candidates=b.max_targets, feature_ids=b.max_feature_ids)
    logits = np.asarray(self._fn(self.params, batch))
    ends = np.cumsum([self.family.num_candidates(u) for u in users])
    return np.split(logits[:ends[-1]], ends[:-1])


class DlrmSUT(mlperf.ThreadedSUT):
  """A LoadGen SUT scoring `samples` (sample index -> a request of the scorer's
  model) with `scorer`."""

  def __init__(self, scorer: Scorer, samples: Sequence):
    self.scorer, self.prompts = scorer, list(samples)  # `prompts`: the QSL, as run_loadgen reads
    self.sizes = [u.num_tokens for u in self.prompts]
    b = scorer.buckets
    for i, n in enumerate(self.sizes):
      if n > b.token_budget:
        raise ValueError(f"sample {i}: {n} tokens, over the token budget {b.token_budget}")
      c = scorer.family.num_candidates(self.prompts[i])
      if c > b.max_targets:
        raise ValueError(f"sample {i}: {c} candidates, over the candidate limit "
                         f"max_targets={b.max_targets}")
    self.scores: dict[int, tuple[int, np.ndarray]] = {}  # query id -> (sample index, logits)
    self.times: dict[int, list[float]] = {}  # query id -> [issued, done]
    self.batch_sizes: list[int] = []
    self.record_labels: list | None = None  # per sample: accuracy-mode responses are records
    self._keep: list = []
    super().__init__("dlrm-sut")
    scorer(self.prompts[:1])  # compile before LoadGen's clock starts

  def issue(self, query_samples) -> None:
    now = time.perf_counter()
    for qs in query_samples:
      self.times[qs.id] = [now, None]
      self._incoming.put((qs.id, qs.index))

  def _loop(self) -> None:
    pending: collections.deque = collections.deque()
    b = self.scorer.buckets
    try:
      while not self._stop.is_set():
        try:
          pending.append(self._incoming.get(timeout=0.005) if not pending else
                         self._incoming.get_nowait())
          continue  # drain everything queued before forming a batch
        except queue.Empty:
          if not pending:
            continue
        batch = take_batch(pending, self.sizes, token_budget=b.token_budget,
                           max_users=b.max_users)
        self._answer(batch, self.scorer([self.prompts[i] for _, i in batch]))
    except BaseException as e:  # noqa: BLE001 - surfaced by stop()
      self.error = e

  def _unanswered(self) -> list[int]:
    return [q for q, t in list(self.times.items()) if t[1] is None]

  def _answer(self, batch, logits) -> None:
    lg = mlperf._lg()
    now = time.perf_counter()
    responses = []
    for (qid, index), z in zip(batch, logits):
      self.scores[qid] = (index, np.asarray(z, np.float32))
      arr = np.ascontiguousarray(z, np.float32) if self.record_labels is None else (
          accuracy_record(index, z, self.record_labels[index]))
      self._keep.append(arr)
      self.times[qid][1] = now
      responses.append(lg.QuerySampleResponse(qid, arr.ctypes.data, arr.nbytes))
    self.batch_sizes.append(len(batch))
    lg.QuerySamplesComplete(responses)

  def measured(self) -> dict:
    """Query latency percentiles (ms) and samples/s, the harness's own view."""
    lat = np.asarray([(t[1] - t[0]) * 1e3 for t in self.times.values() if t[1] is not None])
    if not lat.size:
      return {}
    span = max(t[1] for t in self.times.values() if t[1]) - min(t[0] for t in self.times.values())
    return dict(samples_per_s=lat.size / max(span, 1e-9), mean_batch=float(
        np.mean(self.batch_sizes)), **{f"p{q}_ms": float(np.percentile(lat, q)) for q in (50, 99)})


def accuracy_record(index: int, logits, labels, ts_idx: int = -1) -> np.ndarray:
  """The reference SUT's accuracy-mode response for sample `index`: float32
  [ts_idx, query_idx, sigmoid(logits), labels, weights (1), n]."""
  z = np.asarray(logits, np.float64)
  y = np.asarray(labels)
  if y.shape != z.shape:
    raise ValueError(f"sample {index}: {y.size} labels for {z.size} candidates")
  p = np.exp(-np.logaddexp(0.0, -z))  # sigmoid, stable for any logit
  return np.concatenate([[ts_idx, index], p, y, np.ones_like(p), [z.size]]).astype(np.float32)


def parse_accuracy_log(path: str) -> list[dict]:
  """LoadGen's mlperf_log_accuracy.json of accuracy-mode records, parsed as
  the reference's accuracy.py does (n = the last float; 3n + 3 floats) ->
  per entry {qsl_idx, ts_idx, query_idx, preds, labels, weights}."""
  with open(path) as f:
    entries = json.load(f)
  out = []
  for e in entries:
    d = np.frombuffer(bytes.fromhex(e["data"]), dtype="<f4")
    n = int(d[-1]) if d.size else -1
    if n < 1 or d.size != 3 * n + 3:
      raise ValueError(f"{path}: sample {e['qsl_idx']}: {d.size} floats, not an accuracy "
                       f"record of [ts_idx, query_idx, 3 x n, n] (n = {n})")
    out.append(dict(qsl_idx=e["qsl_idx"], ts_idx=int(d[0]), query_idx=int(d[1]),
                    preds=d[2:2 + n], labels=d[2 + n:2 + 2 * n], weights=d[2 + 2 * n:2 + 3 * n]))
  return out


def accuracy_run(sut: DlrmSUT, labels: Sequence[np.ndarray], *, outdir: str) -> dict:
  """A LoadGen accuracy-mode (Offline) run: every sample once, answered with
  the reference's records (`accuracy_record`, `labels` per sample, per
  candidate); NE / GAUC / accuracy / AUC of the records LoadGen logged."""
  if len(labels) != len(sut.prompts):
    raise ValueError(f"labels: {len(labels)} label arrays for {len(sut.prompts)} samples")
  sut.record_labels = [np.asarray(y) for y in labels]
  try:
    summary = mlperf.run_loadgen(sut, scenario="Offline", mode="accuracy", outdir=outdir,
                                 min_duration_ms=0, min_query_count=len(sut.prompts))
  finally:
    sut.record_labels = None
  recs = parse_accuracy_log(os.path.join(outdir, "mlperf_log_accuracy.json"))
  cat = lambda k: np.concatenate([r[k] for r in recs]).astype(np.float64)
  m = metrics.evaluate_probs(cat("labels"), cat("preds"), cat("weights"),
                             [len(r["preds"]) for r in recs])
  return dict(samples=len({r["qsl_idx"] for r in recs}), summary=summary, **m)


def benchmark_samples(cfg, num_samples: int, *, seed: int = 0, dataset=None) -> tuple:
  """(requests, labels) of `num_samples` users for cfg's model: read from
  `dataset` (a `recsys.streaming.StreamingDataset`: MLPerf's files, at its
  current timestamp) when given, else drawn on demand: DLRMv3 from the
  reference generator's distributions (`synthetic_requests.for_model`), the
  paper-era HSTU from `recsys.synthetic` (5M users, 1% of the items)."""
  if dataset is not None:
    n = len(dataset)
    if n < num_samples:
      raise ValueError(f"dataset: {n} requests at its timestamp, fewer than num_samples "
                       f"{num_samples}")
    reqs = [dataset.request(i * n // num_samples) for i in range(num_samples)]
    return reqs, [r.labels for r in reqs]
  if family.of(cfg) is family.DLRM_V3:
    reqs = synthetic_requests.samples(synthetic_requests.for_model(cfg, seed=seed), num_samples)
    return reqs, [r.labels for r in reqs]
  spec = synthetic.for_model(cfg, num_users=5_000_000, seed=seed)
  step = spec.num_users // num_samples
  users, labels = zip(*(synthetic.sample(spec, i * step) for i in range(num_samples)))
  return list(users), list(labels)


def run_benchmark(cfg, params, *, outdir: str, num_samples: int = 256,
                  scenarios: Sequence[str] = ("Server", "Offline"), server_qps: float = 200.0,
                  offline_qps: float = 4000.0, latency_ms: float = 80.0, token_budget: int = 256,
                  max_users: int = 16, min_duration_ms: int = 1000, min_query_count: int = 500,
                  seed: int = 0, dataset=None) -> list[dict]:
  """LoadGen runs of cfg's model on `benchmark_samples` (MLPerf's data set
  files when `dataset` is given): each scenario in performance mode, then one
  accuracy run (NE / GAUC / accuracy / AUC from LoadGen's log). -> one row per run."""
  users, labels = benchmark_samples(cfg, num_samples, seed=seed, dataset=dataset)
  scorer = Scorer(cfg, params, Buckets.for_samples(cfg, users, token_budget=token_budget,
                                                   max_users=max_users))
  rows = []
  for scenario in scenarios:
    sut = DlrmSUT(scorer, users)
    s = mlperf.run_loadgen(
        sut, scenario=scenario, outdir=os.path.join(outdir, scenario),
        target_qps=server_qps if scenario == "Server" else offline_qps, latency_ms=latency_ms,
        min_duration_ms=min_duration_ms, min_query_count=min_query_count, seed=seed)
    lg_rate = s.get("Samples per second") or s.get("Completed samples per second")
    rows.append(dict(scenario=scenario, mode="performance", valid=s["valid"],
                     loadgen_samples_per_s=lg_rate,
                     loadgen_p99_ms=s.get("99.00 percentile latency (ns)", float("nan")) / 1e6,
                     **sut.measured()))
  acc = accuracy_run(DlrmSUT(scorer, users), labels, outdir=os.path.join(outdir, "accuracy"))
  # Accuracy mode is not judged for performance (LoadGen's summary says INVALID).
  rows.append(dict(scenario="Offline", mode="accuracy", samples=acc["samples"], ne=acc["ne"],
                   gauc=acc["gauc"], gauc_groups=acc["gauc_groups"], auc=acc["auc"],
                   accuracy=acc["accuracy"]))
  return rows
