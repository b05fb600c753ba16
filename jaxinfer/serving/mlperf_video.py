"""MLPerf LoadGen glue for text to video: a SUT over a `VideoEngine`, the
SingleStream and Offline scenarios of `text_to_video/wan-2.2-t2v-a14b`.

  samples = prompt_samples(prompts, latents)  # sample index -> VideoRequest
  sut = VideoSUT(engine, samples)
  summary = run_video_loadgen(sut, scenario="SingleStream", outdir="...")

A sample's prompt is a string (the benchmark's prompts, tokenized and
encoded by the engine's text encoder inside the timed run, as the
reference's WanPipeline does), token ids or embeddings (`VideoRequest`).

LoadGen issues query samples from its own threads; the SUT queues them and
one thread of ours runs them through the engine, `engine.max_batch` at a
time (SingleStream: one in flight; Offline: all issued at once), and
completes each with its video's uint8 bytes. The SUT keeps what it
reported (sample index and a digest of the bytes per query) for checks
after the run. Sample-level latency only: no token latencies.
"""

from __future__ import annotations

import hashlib
import queue
import time

import numpy as np

from jaxinfer.engine.video import VideoEngine, VideoRequest
from jaxinfer.serving import mlperf

VIDEO_SCENARIOS = ("SingleStream", "Offline")


def digest(frames: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


def prompt_samples(prompts: list[str], latents: np.ndarray,
                   negative_prompt: str = "") -> list[VideoRequest]:
  """The benchmark's samples: each prompt with one negative prompt
  (WanPipeline's default: "") and the one fixed initial latent [C, F, h, w]."""
  latents = np.asarray(latents, np.float32)
  return [VideoRequest(p, negative_prompt, latents) for p in prompts]


class VideoSUT(mlperf.ThreadedSUT):
  def __init__(self, engine: VideoEngine, samples: list[VideoRequest]):
    for i, s in enumerate(samples):
      try:
        engine.check_request(s)
      except ValueError as e:
        raise type(e)(f"sample {i}: {e}") from None
    self.engine, self.samples = engine, list(samples)
    self.completed: dict[int, tuple[int, str]] = {}  # query id -> (sample index, digest)
    self.latencies_s: list[float] = []
    self._keep: list = []
    super().__init__("video-sut")

  def issue(self, query_samples) -> None:
    now = time.perf_counter()
    for qs in query_samples:
      self._incoming.put((qs.id, qs.index, now))

  def _take(self) -> list:
    try:
      items = [self._incoming.get(timeout=0.005)]
    except queue.Empty:
      return []
    while len(items) < self.engine.max_batch:
      try:
        items.append(self._incoming.get_nowait())
      except queue.Empty:
        break
    return items

  def _loop(self) -> None:
    lg = mlperf._lg()
    try:
      while not self._stop.is_set():
        items = self._take()
        if not items:
          continue
        videos = self.engine.generate([self.samples[index] for _, index, _ in items])
        done = time.perf_counter()
        responses = []
        for (qid, index, issued), video in zip(items, videos):
          self._keep.append(video)
          self.completed[qid] = (index, digest(video))
          self.latencies_s.append(done - issued)
          responses.append(lg.QuerySampleResponse(qid, video.ctypes.data, video.nbytes))
        lg.QuerySamplesComplete(responses)
    except BaseException as e:  # noqa: BLE001 - surfaced by stop()
      self.error = e


def _settings(lg, scenario: str, mode: str, *, expected_latency_ms: float, target_qps: float,
              min_duration_ms: int, min_query_count: int, max_query_count: int, seed: int):
  settings = lg.TestSettings()
  settings.scenario = (lg.TestScenario.SingleStream if scenario == "SingleStream"
                       else lg.TestScenario.Offline)
  settings.mode = lg.TestMode.PerformanceOnly if mode == "performance" else lg.TestMode.AccuracyOnly
  settings.min_duration_ms = int(min_duration_ms)
  settings.min_query_count = int(min_query_count)
  if max_query_count:
    settings.max_query_count = int(max_query_count)
  settings.single_stream_expected_latency_ns = int(expected_latency_ms * 1e6)
  settings.offline_expected_qps = float(target_qps)
  settings.qsl_rng_seed = settings.sample_index_rng_seed = settings.schedule_rng_seed = seed
  return settings


def run_video_loadgen(sut: VideoSUT, *, scenario: str, outdir: str, mode: str = "performance",
                      expected_latency_ms: float = 1000.0, target_qps: float = 1.0,
                      min_duration_ms: int = 10_000, min_query_count: int = 1,
                      max_query_count: int = 0, performance_sample_count: int | None = None,
                      seed: int = 0) -> dict:
  """Runs one LoadGen test over the SUT; -> the parsed summary (`mlperf.parse_summary`,
  "valid": LoadGen's verdict)."""
  if scenario not in VIDEO_SCENARIOS:
    raise ValueError(f"scenario must be one of {VIDEO_SCENARIOS}, got {scenario!r}")
  if mode not in ("performance", "accuracy"):
    raise ValueError(f"mode must be 'performance' or 'accuracy', got {mode!r}")
  lg = mlperf._lg()
  settings = _settings(lg, scenario, mode, expected_latency_ms=expected_latency_ms,
                       target_qps=target_qps, min_duration_ms=min_duration_ms,
                       min_query_count=min_query_count, max_query_count=max_query_count,
                       seed=seed)
  return mlperf.run_test(sut, settings, outdir, len(sut.samples), performance_sample_count)
