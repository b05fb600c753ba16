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
scores it sent (`scores`) for the metrics (`recsys.metrics`).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Sequence

import jax
import numpy as np

from jaxinfer.recsys import hstu
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


class DlrmSUT:
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
    self._incoming: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True, name="dlrm-sut")
    self.error: BaseException | None = None
    scorer(self.prompts[:1])  # compile before LoadGen's clock starts

  def issue(self, query_samples) -> None:
    now = time.perf_counter()
    for qs in query_samples:
      self.times[qs.id] = [now, None]
      self._incoming.put((qs.id, qs.index))

  def flush(self) -> None:
    pass

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()
    if self.error is not None:
      raise RuntimeError("the scoring thread failed") from self.error

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
