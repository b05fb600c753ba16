"""The LoadGen SUT: real mlperf_loadgen runs (short) over a tiny engine;
every sample completes, the first token reported equals the first output
token, and LoadGen's token counts equal ours."""

import dataclasses

import jax
import mlperf_loadgen  # noqa: F401  (the dev extra installs mlcommons-loadgen)
import numpy as np
import pytest

from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.serving import mlperf


def _sut(first_token_events):
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=2), dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 9, 13, 7)]
  engine = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, max_num_seqs=4))
  sampling = SamplingParams(max_tokens=6)
  ref = {i: o.token_ids for i, o in enumerate(engine.generate(prompts, sampling))}
  return mlperf.EngineSUT(engine, prompts, sampling, first_token_events=first_token_events), ref


@pytest.mark.parametrize("scenario", ["Offline", "Server"])
def test_loadgen_run_completes_and_complies(scenario, tmp_path):
  sut, ref = _sut(first_token_events=scenario != "Offline")
  summary = mlperf.run_loadgen(sut, scenario=scenario, outdir=str(tmp_path), target_qps=20.0,
                               ttft_ms=5000, tpot_ms=1000, min_duration_ms=300,
                               min_query_count=8)
  comp = sut.compliance()
  assert comp["completed"] >= 8 and not comp["first_token_mismatches"], comp
  # Greedy: every completed sample carries its reference tokens.
  assert all(tokens == ref[i] for i, tokens in sut.completed.values())
  assert summary["Scenario"] == scenario
  tokens_key = "Completed tokens per second" if scenario == "Server" else "Tokens per second"
  assert summary[tokens_key] > 0
  mine = sut.measured()
  # LoadGen's token throughput and ours count the same tokens over nearly the same span.
  assert mine["tokens_per_s"] == pytest.approx(summary[tokens_key], rel=0.25)


def test_bad_samples_are_named():
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32")
  engine = Engine(cfg, models.init_params(cfg, jax.random.key(0)),
                  EngineConfig(page_size=8, num_pages=16))
  with pytest.raises(ValueError, match="sample 1"):
    mlperf.EngineSUT(engine, [[1, 2], [cfg.vocab_size]], SamplingParams(max_tokens=2))
  with pytest.raises(ValueError, match="scenario"):
    mlperf.run_loadgen(mlperf.EngineSUT(engine, [[1, 2]], SamplingParams(max_tokens=2)),
                       scenario="SingleStream", outdir="/tmp/unused")


def test_parse_accuracy_log_reads_loadgen_bytes(tmp_path):
  import json as _json
  import numpy as _np
  from jaxinfer.serving import mlperf as _mlperf
  rows = [{"seq_id": 0, "qsl_idx": 3, "data": _np.asarray([5, 70000, 2], "<i4").tobytes().hex().upper()},
          {"seq_id": 1, "qsl_idx": 1, "data": _np.asarray([9], "<i4").tobytes().hex()}]
  path = tmp_path / "mlperf_log_accuracy.json"
  path.write_text(_json.dumps(rows))
  assert _mlperf.parse_accuracy_log(str(path)) == {3: [5, 70000, 2], 1: [9]}
  rows.append({"seq_id": 2, "qsl_idx": 3, "data": _np.asarray([6], "<i4").tobytes().hex()})
  path.write_text(_json.dumps(rows))
  with pytest.raises(ValueError, match="sample 3 logged twice"):
    _mlperf.parse_accuracy_log(str(path))


def test_multimodal_dataset_through_loadgen(tmp_path):
  """A JSONL dataset of prompts with image paths (the tiny Qwen3-VL fixture):
  every completed sample carries Engine.generate's tokens for its image."""
  import json
  import jax.numpy as jnp
  from vl_inputs import A, B, PROC, VL
  from jaxinfer import checkpoint
  from jaxinfer.serving import workloads
  cfg, params = checkpoint.load_hf(str(VL / "qwen3_vl"), dtype=jnp.float32)
  (tmp_path / "a.png").write_bytes(A)
  (tmp_path / "b.png").write_bytes(B)
  rows = [{"tokens": [1, 2, 120, 3], "images": ["a.png"]},
          {"text": "hi <image> there", "images": ["b.png"]}, {"tokens": [5, 6, 7]}]
  (tmp_path / "ds.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
  prompts, images = workloads.read_prompts(str(tmp_path / "ds.jsonl"),
                                           encode=lambda t: [b % 100 for b in t.encode()],
                                           vision=cfg.vision)
  assert prompts[1].count(120) == 1 and images[2] is None and images[0][0].endswith("a.png")
  (tmp_path / "bad.jsonl").write_text(json.dumps({"tokens": [1, 120, 120], "images": ["a.png"]}))
  with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
    workloads.read_prompts(str(tmp_path / "bad.jsonl"), vision=cfg.vision)
  engine = Engine(cfg, params, EngineConfig(page_size=4, num_pages=96, max_num_seqs=4,
                                            image_processor=PROC))
  sampling = SamplingParams(max_tokens=3)
  ref = {i: o.token_ids for i, o in enumerate(engine.generate(prompts, sampling, images=images))}
  sut = mlperf.EngineSUT(engine, prompts, sampling, first_token_events=False, images=images)
  mlperf.run_loadgen(sut, scenario="Offline", outdir=str(tmp_path / "lg"), target_qps=20.0,
                     ttft_ms=5000, tpot_ms=1000, min_duration_ms=300, min_query_count=6)
  assert sut.compliance()["completed"] >= 6
  assert all(tokens == ref[i] for i, tokens in sut.completed.values())
