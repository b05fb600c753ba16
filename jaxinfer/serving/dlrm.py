"""DLRMv3 serving: a batcher that packs jagged requests up to a token budget,
and a LoadGen system under test over it (`mlperf.run_loadgen`, query
latencies: Server's p99 limit is 80 ms).

  scorer = Scorer(cfg, params, Buckets.for_samples(users, token_budget=512, max_users=16))
  sut = DlrmSUT(scorer, users)
  summary = mlperf.run_loadgen(sut, scenario="Server", latency_ms=80, target_qps=..., outdir=...)

A request is one user (`recsys.batch.User`); its response is the float32
logits of its candidates. The batcher takes queued requests in arrival order
while their tokens fit the budget (and the user slots last), packs them into
one token axis (`recsys.batch.pack`) at fixed buckets, so every batch runs
one compiled program, scores them and answers each query. The SUT keeps the
scores it sent (`scores`); `accuracy_run` scores every sample once in
LoadGen's accuracy mode and computes NE / AUC / accuracy (`recsys.metrics`)
from the scores LoadGen logged.
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

from jaxinfer.recsys import hstu, metrics, synthetic
from jaxinfer.recsys.batch import User, pack
from jaxinfer.recsys.config import HSTUConfig
from jaxinfer.serving import mlperf


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buckets:
  """A batch's fixed shapes: tokens (the budget), users, candidates, ids per
  user-feature table."""
  token_budget: int
  max_users: int
  max_targets: int
  max_feature_ids: int

  @classmethod
  def for_samples(cls, samples: Sequence[User], *, token_budget: int, max_users: int):
    """Buckets that hold any max_users of `samples`."""
    cand = max(len(u.candidates) for u in samples)
    feats = max((len(bag) for u in samples for bag in u.features), default=1)
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

  def __init__(self, cfg: HSTUConfig, params, buckets: Buckets):
    self.cfg, self.params, self.buckets = cfg, params, buckets
    self._fn = jax.jit(lambda p, b: hstu.score(cfg, p, b))

  def __call__(self, users: Sequence[User]) -> list[np.ndarray]:
    """Per user, its candidates' logits (float32)."""
    b = self.buckets
    batch = pack(self.cfg, users, token_bucket=b.token_budget, user_bucket=b.max_users,
                 target_bucket=b.max_targets, feature_bucket=b.max_feature_ids)
    logits = np.asarray(self._fn(self.params, batch))
    ends = np.cumsum([len(u.candidates) for u in users])
    return np.split(logits[:ends[-1]], ends[:-1])


class DlrmSUT(mlperf.ThreadedSUT):
  """A LoadGen SUT scoring `samples` (sample index -> User) with `scorer`."""

  def __init__(self, scorer: Scorer, samples: Sequence[User]):
    self.scorer, self.prompts = scorer, list(samples)  # `prompts`: the QSL, as run_loadgen reads
    self.sizes = [u.num_tokens for u in self.prompts]
    b = scorer.buckets
    for i, n in enumerate(self.sizes):
      if n > b.token_budget:
        raise ValueError(f"sample {i}: {n} tokens, over the token budget {b.token_budget}")
    self.scores: dict[int, tuple[int, np.ndarray]] = {}  # query id -> (sample index, logits)
    self.times: dict[int, list[float]] = {}  # query id -> [issued, done]
    self.batch_sizes: list[int] = []
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

  def _answer(self, batch, logits) -> None:
    lg = mlperf._lg()
    now = time.perf_counter()
    responses = []
    for (qid, index), z in zip(batch, logits):
      arr = np.ascontiguousarray(z, np.float32)
      self._keep.append(arr)
      self.scores[qid] = (index, arr)
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


def parse_scores_log(path: str) -> dict[int, np.ndarray]:
  """LoadGen's mlperf_log_accuracy.json (accuracy mode: the bytes each response
  handed LoadGen, hex) -> {sample index: float32 logits}, what MLPerf scores."""
  with open(path) as f:
    entries = json.load(f)
  out = {}
  for e in entries:
    z = np.frombuffer(bytes.fromhex(e["data"]), dtype="<f4").copy()
    if e["qsl_idx"] in out and not np.array_equal(out[e["qsl_idx"]], z):
      raise ValueError(f"{path}: sample {e['qsl_idx']} logged twice with different scores")
    out[e["qsl_idx"]] = z
  return out


def accuracy_run(sut: DlrmSUT, labels: Sequence[np.ndarray], *, outdir: str) -> dict:
  """A LoadGen accuracy-mode (Offline) run: every sample once; NE / AUC /
  accuracy of the logged scores against `labels` (per sample, per candidate)."""
  if len(labels) != len(sut.prompts):
    raise ValueError(f"labels: {len(labels)} label arrays for {len(sut.prompts)} samples")
  summary = mlperf.run_loadgen(sut, scenario="Offline", mode="accuracy", outdir=outdir,
                               min_duration_ms=0, min_query_count=len(sut.prompts))
  logged = parse_scores_log(os.path.join(outdir, "mlperf_log_accuracy.json"))
  idx = sorted(logged)
  y = np.concatenate([np.asarray(labels[i]) for i in idx])
  z = np.concatenate([logged[i] for i in idx])
  return dict(samples=len(idx), summary=summary, **metrics.evaluate(y, z))


def run_benchmark(cfg: HSTUConfig, params, *, outdir: str, num_samples: int = 256,
                  scenarios: Sequence[str] = ("Server", "Offline"), server_qps: float = 200.0,
                  offline_qps: float = 4000.0, latency_ms: float = 80.0, token_budget: int = 256,
                  max_users: int = 16, min_duration_ms: int = 1000, min_query_count: int = 500,
                  seed: int = 0) -> list[dict]:
  """LoadGen runs of `cfg` on the synthetic data set (`recsys.synthetic`, the
  benchmark's shape: 5M users, 1% of the items; `num_samples` of them spread
  over the users): each scenario in performance mode, then one accuracy run
  (NE / AUC / accuracy from LoadGen's log). -> one row per run."""
  spec = synthetic.for_model(cfg, num_users=5_000_000, seed=seed)
  step = spec.num_users // num_samples
  users, labels = zip(*(synthetic.sample(spec, i * step) for i in range(num_samples)))
  scorer = Scorer(cfg, params, Buckets.for_samples(users, token_budget=token_budget,
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
                   auc=acc["auc"], accuracy=acc["accuracy"]))
  return rows
