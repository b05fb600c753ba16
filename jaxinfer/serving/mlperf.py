"""MLPerf LoadGen glue: a QSL over token-id prompts and a SUT over an
`Engine`, with the LLM scenarios' token latencies.

  sut = EngineSUT(engine, prompts, sampling)
  summary = run_loadgen(sut, scenario="Server", target_qps=2.0, ttft_ms=..., tpot_ms=...,
                        outdir="...")

LoadGen (`pip install mlcommons-loadgen`, the `mlperf` extra) issues query
samples from its own threads; the SUT queues them, and one thread of ours
submits them to the engine and steps it. The first token of every sample
goes back with `FirstTokenComplete` (all scenarios but Offline), the whole
output with `QuerySamplesComplete` and its token count, as the reference
SUTs of mlcommons/inference do. The SUT keeps what it reported, so a run
can be checked afterwards: the first token reported equals the first token
of the output, and the token counts match (the compliance rule).
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time

import numpy as np

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingParams

SCENARIOS = ("Offline", "Server", "Interactive")


def _lg():
  try:
    import mlperf_loadgen
  except ImportError as e:
    raise ImportError("MLPerf LoadGen is not installed: pip install mlcommons-loadgen "
                      "(or pip install -e '.[mlperf]')") from e
  return mlperf_loadgen


class ThreadedSUT:
  """The LoadGen SUT lifecycle the in-process SUTs share: LoadGen's threads
  put queries on `_incoming` (`issue`), one worker thread (`_loop`, the
  subclass's) serves them until `stop`, and a failure of that thread is
  raised from `stop` instead of lost. After a failure the thread answers
  every query left (the ones it held, `_unanswered`, and every one issued
  later) with an empty response, so LoadGen's run ends and `stop` raises,
  instead of LoadGen waiting forever. `EngineSUT`, `mlperf_video.VideoSUT`
  and `dlrm.DlrmSUT` are ones."""

  def __init__(self, name: str):
    self._incoming: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
    self.error: BaseException | None = None

  def _loop(self) -> None:
    raise NotImplementedError

  def _unanswered(self) -> list[int]:
    """Query ids the loop took off `_incoming` and did not answer (subclasses)."""
    return []

  def _serve(self) -> None:
    self._loop()
    if self.error is None:
      return
    lg, done = _lg(), set()

    def answer(ids):
      ids = [q for q in ids if q not in done]
      done.update(ids)
      if ids:
        lg.QuerySamplesComplete([lg.QuerySampleResponse(q, 0, 0) for q in ids])

    answer(self._unanswered())
    while not self._stop.is_set():
      try:
        answer([self._incoming.get(timeout=0.005)[0]])
      except queue.Empty:
        continue

  def flush(self) -> None:
    pass

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()
    if self.error is not None:
      raise RuntimeError(f"the {self._thread.name} thread failed") from self.error


class SUTRecord:
  """What a SUT reported to LoadGen, kept for checks after the run: the
  issue / first-token / done times, the first token sent and the tokens
  completed per query. `EngineSUT` and `mlperf_http.HttpSUT` share it."""

  def __init__(self, prompts):
    self.prompts = [list(p) for p in prompts]
    self._keep: list = []  # response buffers LoadGen reads after the call returns
    self.reported_first: dict[int, int] = {}  # query id -> first token sent
    self.completed: dict[int, tuple[int, list[int]]] = {}  # query id -> (sample index, tokens)
    self.times: dict[int, list[float]] = {}  # query id -> [issued, first token, done] (perf_counter)

  def _respond(self, qid: int, tokens: list[int], first: bool) -> None:
    lg = _lg()
    arr = np.asarray(tokens[:1] if first else tokens, np.int32)
    self._keep.append(arr)
    resp = lg.QuerySampleResponse(qid, arr.ctypes.data, arr.nbytes, len(arr))
    if first:
      lg.FirstTokenComplete([resp])
    else:
      lg.QuerySamplesComplete([resp])

  def measured(self) -> dict:
    """The harness's own view of the run (to set beside LoadGen's summary):
    tokens/s over first issue to last completion, TTFT and TPOT percentiles
    in ms (TPOT = (latency - TTFT) / (tokens - 1), LoadGen's definition)."""
    done = [(self.times[q], len(t)) for q, (_, t) in self.completed.items()]
    if not done:
      return {}
    start = min(t[0] for t, _ in done)
    end = max(t[2] for t, _ in done)
    ttft = np.asarray([(t[1] - t[0]) * 1e3 for t, _ in done])
    tpot = np.asarray([(t[2] - t[1]) * 1e3 / (n - 1) for t, n in done if n > 1])
    pct = lambda a: {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)} if a.size else {}
    return dict(tokens_per_s=sum(n for _, n in done) / max(end - start, 1e-9),
                samples_per_s=len(done) / max(end - start, 1e-9),
                ttft_ms=dict(mean=float(ttft.mean()), **pct(ttft)),
                tpot_ms=dict(mean=float(tpot.mean()) if tpot.size else float("nan"), **pct(tpot)))

  def compliance(self) -> dict:
    """The first token reported equals the first output token, for every
    completed query; -> counts (mismatches listed by query id)."""
    bad = [q for q, (_, toks) in self.completed.items()
           if not toks or self.reported_first.get(q) != toks[0]]
    return dict(completed=len(self.completed), first_token_mismatches=bad,
                output_tokens=sum(len(t) for _, t in self.completed.values()))


class EngineSUT(SUTRecord, ThreadedSUT):
  """A LoadGen system under test serving `prompts` (sample index -> token ids)."""

  def _unanswered(self) -> list[int]:
    return [q for q, t in list(self.times.items()) if t[2] is None]

  def __init__(self, engine: Engine, prompts, sampling: SamplingParams, *,
               first_token_events: bool = True, images=None):
    SUTRecord.__init__(self, prompts)
    ThreadedSUT.__init__(self, "engine-sut")
    self.engine, self.sampling = engine, sampling
    # Per sample its images or None (a vision model; decoded and encoded on
    # submit, each distinct image once while the encoder cache holds it).
    self.images = list(images) if images is not None else [None] * len(self.prompts)
    if len(self.images) != len(self.prompts):
      raise ValueError(f"images: {len(self.images)} image lists for {len(self.prompts)} prompts")
    for i, p in enumerate(self.prompts):
      try:
        engine.check_request(p, sampling)
      except (ValueError, TypeError) as e:
        raise type(e)(f"sample {i}: {e}") from None
    self.first_token_events = first_token_events
    self._live: dict[int, tuple[int, int]] = {}  # engine rid -> (query id, sample index)
    self._sent_first: set[int] = set()

  # LoadGen callbacks (its threads)
  def issue(self, query_samples) -> None:
    now = time.perf_counter()
    for qs in query_samples:
      self.times[qs.id] = [now, None, None]
      self._incoming.put((qs.id, qs.index))

  def _loop(self) -> None:
    try:
      while not self._stop.is_set():
        self._admit(wait=not self.engine.has_unfinished())
        if not self.engine.has_unfinished():
          continue
        for rid, new, finished in self.engine.step():
          if rid not in self._live:
            continue
          qid, index = self._live[rid]
          if new and rid not in self._sent_first:
            self._sent_first.add(rid)
            self.reported_first[qid] = int(new[0])
            self.times[qid][1] = time.perf_counter()
            if self.first_token_events:
              self._respond(qid, [int(new[0])], first=True)
          if finished:
            tokens = self.engine.output(rid).token_ids
            self.completed[qid] = (index, tokens)
            self.times[qid][2] = time.perf_counter()
            del self._live[rid]
            self._respond(qid, tokens, first=False)
    except BaseException as e:  # noqa: BLE001 - surfaced by stop()
      self.error = e

  def _admit(self, wait: bool) -> None:
    """Submits the queued samples; an idle engine first waits briefly for one."""
    try:
      item = self._incoming.get(timeout=0.005) if wait else self._incoming.get_nowait()
    except queue.Empty:
      return
    while True:
      qid, index = item
      extra = {} if self.images[index] is None else dict(images=self.images[index])
      self._live[self.engine.submit(self.prompts[index], self.sampling, **extra)] = (qid, index)
      try:
        item = self._incoming.get_nowait()
      except queue.Empty:
        return

def run_loadgen(sut: SUTRecord, *, scenario: str, outdir: str, mode: str = "performance",
                target_qps: float = 1.0, ttft_ms: float | None = None,
                tpot_ms: float | None = None, min_duration_ms: int = 10_000,
                min_query_count: int = 1, max_query_count: int = 0,
                performance_sample_count: int | None = None, seed: int = 0,
                latency_ms: float | None = None) -> dict:
  """Runs one LoadGen test; -> the parsed summary (`parse_summary`).
  `sut.prompts` is the QSL's samples. latency_ms: a query-latency p99 limit
  instead of token latencies (non-LLM benchmarks, e.g. DLRMv3's 80 ms Server)."""
  if scenario not in SCENARIOS:
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
  if mode not in ("performance", "accuracy"):
    raise ValueError(f"mode must be 'performance' or 'accuracy', got {mode!r}")
  lg = _lg()
  settings = lg.TestSettings()
  settings.scenario = lg.TestScenario.Offline if scenario == "Offline" else lg.TestScenario.Server
  settings.mode = lg.TestMode.PerformanceOnly if mode == "performance" else lg.TestMode.AccuracyOnly
  settings.use_token_latencies = latency_ms is None
  if latency_ms is not None:
    settings.server_target_latency_ns = int(latency_ms * 1e6)
    settings.server_target_latency_percentile = 0.99
  settings.min_duration_ms = int(min_duration_ms)
  settings.min_query_count = int(min_query_count)
  if max_query_count:
    settings.max_query_count = int(max_query_count)
  settings.server_target_qps = float(target_qps)
  settings.offline_expected_qps = float(target_qps)
  settings.qsl_rng_seed = settings.sample_index_rng_seed = settings.schedule_rng_seed = seed
  if ttft_ms is not None:
    settings.ttft_latency = int(ttft_ms * 1e6)
  if tpot_ms is not None:
    settings.tpot_latency = int(tpot_ms * 1e6)
  return run_test(sut, settings, outdir, len(sut.prompts), performance_sample_count)


def run_test(sut, settings, outdir: str, num_samples: int,
             performance_sample_count: int | None = None) -> dict:
  """One LoadGen test of `sut` (issue, flush, start, stop: a `ThreadedSUT`)
  under `settings`, over a QSL of num_samples samples the SUT holds itself
  (LoadGen loads nothing), its logs in outdir -> `parse_summary`'s dict. The
  SUT is stopped (raising its thread's failure) even when LoadGen fails."""
  lg = _lg()
  os.makedirs(outdir, exist_ok=True)
  log = lg.LogSettings()
  log.log_output.outdir = outdir
  log.log_output.copy_summary_to_stdout = False
  n = num_samples
  qsl = lg.ConstructQSL(n, performance_sample_count or n, lambda idx: None, lambda idx: None)
  lg_sut = lg.ConstructSUT(sut.issue, sut.flush)
  sut.start()
  try:
    lg.StartTestWithLogSettings(lg_sut, qsl, settings, log)
  finally:
    sut.stop()
    lg.DestroySUT(lg_sut)
    lg.DestroyQSL(qsl)
  return parse_summary(os.path.join(outdir, "mlperf_log_summary.txt"))


def parse_summary(path: str) -> dict:
  """LoadGen's mlperf_log_summary.txt -> {"valid": bool, "<field>": value}."""
  out = {}
  with open(path) as f:
    for line in f:
      m = re.match(r"\s*([^:=]+?)\s*[:=]\s*(.+?)\s*$", line)
      if not m:
        continue
      key, value = m.group(1), m.group(2)
      try:
        out[key] = float(value)
      except ValueError:
        out[key] = value
  out["valid"] = str(out.get("Result is", "")).upper() == "VALID"
  return out


def parse_accuracy_log(path: str) -> dict[int, list[int]]:
  """LoadGen's mlperf_log_accuracy.json (accuracy mode: the bytes each
  QuerySamplesComplete handed LoadGen, hex, here int32 token ids) ->
  {qsl_idx: token ids}. What LoadGen received, independent of the SUT's
  own bookkeeping: MLPerf scores accuracy from this log."""
  import json
  with open(path) as f:
    entries = json.load(f)
  out = {}
  for e in entries:
    tokens = np.frombuffer(bytes.fromhex(e["data"]), dtype="<i4").tolist()
    if e["qsl_idx"] in out and out[e["qsl_idx"]] != tokens:
      raise ValueError(f"{path}: sample {e['qsl_idx']} logged twice with different tokens")
    out[e["qsl_idx"]] = tokens
  return out
