"""The VideoEngine and its LoadGen SUT on the tiny random WAN-2.2 model (CPU):
a request's video does not depend on its batch position or padding, and real mlperf_loadgen
SingleStream and Offline runs complete every sample and are VALID."""

import jax
import mlperf_loadgen  # noqa: F401  (the dev extra installs mlcommons-loadgen)
import numpy as np
import pytest

from jaxinfer.diffusion import presets, wan_vae, wan_weights
from jaxinfer.engine.video import VideoEngine, VideoRequest
from jaxinfer.serving import mlperf_video

MODEL = presets.tiny()


@pytest.fixture(scope="module")
def engine_and_samples():
  k = jax.random.split(jax.random.key(0), 3)
  high, low = (wan_weights.init_params(MODEL.dit, key) for key in k[:2])
  vae = wan_vae.init_params(MODEL.vae, k[2])
  rng = np.random.default_rng(0)
  latent = rng.standard_normal(MODEL.latent_shape()[1:]).astype(np.float32)  # fixed, as MLPerf
  text = lambda: rng.standard_normal((MODEL.text_len, MODEL.dit.text_dim)).astype(np.float32)
  samples = [VideoRequest(text(), text(), latent) for _ in range(3)]
  return VideoEngine(MODEL, high, low, vae, max_batch=2), samples, (high, low, vae)


@pytest.fixture(autouse=True)
def _optimized(optimized):
  """XLA's full optimisation: LoadGen's SingleStream needs 64 queries for its
  early-stopping verdict, and at LLVM level 0 the tiny VAE decode alone takes
  0.19 s (6 ms optimised); one compiled program serves every test here."""
  yield


def test_batched_videos_equal_across_batch_positions(engine_and_samples):
  engine, samples, (high, low, vae) = engine_and_samples
  videos = engine.generate(samples)  # [s0, s1], then [s2, s2 (padding)]
  assert engine.stats() == dict(batches=2, videos=3, padded=1)
  assert len(videos) == 3 and videos[0].shape == (MODEL.frames, MODEL.height, MODEL.width, 3)
  assert videos[0].dtype == np.uint8
  again = engine.generate([samples[2], samples[0]])  # s2 first, s0 second: same program
  assert np.max(np.abs(again[0].astype(int) - videos[2])) <= 1
  assert np.max(np.abs(again[1].astype(int) - videos[0])) <= 1
  assert not np.array_equal(videos[0], videos[1])  # the prompt matters
  assert np.std(videos[0]) > 1.0


def test_bad_requests_are_named(engine_and_samples):
  engine, samples, _ = engine_and_samples
  bad = VideoRequest(samples[0].text[:-1], samples[0].neg_text, samples[0].latents)
  with pytest.raises(ValueError, match=r"request 1: VideoRequest.text must be"):
    engine.generate([samples[0], bad])
  with pytest.raises(ValueError, match=r"sample 0: VideoRequest.latents must be"):
    mlperf_video.VideoSUT(engine, [VideoRequest(samples[0].text, samples[0].text,
                                                samples[0].latents[:, :2])])
  with pytest.raises(ValueError, match="scenario"):
    mlperf_video.run_video_loadgen(mlperf_video.VideoSUT(engine, samples), scenario="Server",
                                   outdir="/tmp/unused")


@pytest.mark.parametrize("scenario", ["SingleStream", "Offline"])
def test_loadgen_run_is_valid(engine_and_samples, scenario, tmp_path):
  engine, samples, _ = engine_and_samples
  ref = {i: mlperf_video.digest(v) for i, v in enumerate(engine.generate(samples))}
  sut = mlperf_video.VideoSUT(engine, samples)
  # Offline issues max(min_query_count, target_qps x min duration x 1.1) samples
  # in one query, which must last the min duration: 20 QPS gave 64 samples, done
  # in 0.19 s at the 329 samples/s a faster machine measured (INVALID).
  # SingleStream pre-generates max(min_query_count, min duration / expected
  # latency) queries: at 50 ms that was 64, done in 0.23 s at the 3.6 ms a video
  # took on a faster machine (min duration not met, INVALID); at 1 ms it is 300,
  # and LoadGen stops once both minimums are met.
  summary = mlperf_video.run_video_loadgen(
      sut, scenario=scenario, outdir=str(tmp_path), expected_latency_ms=1,
      target_qps=1000 if scenario == "Offline" else 20, min_duration_ms=300, min_query_count=64)
  assert summary["Scenario"] == scenario
  assert summary["valid"], summary
  assert len(sut.completed) >= 64
  # Every completed sample carries the video of its request.
  assert all(d == ref[i] for i, d in sut.completed.values())
