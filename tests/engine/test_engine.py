"""Engine behaviour: greedy parity for every architecture (chunked prefill,
preemption, prefix caching), sampling, abort and page accounting, bad input,
bounded compiles."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import FIXTURES, assert_no_leak as _no_leak, random_prompts as _prompts
from jaxinfer import Engine, EngineConfig, ModelConfig, SamplingParams, engine, models, presets
from jaxinfer.engine import steps
from jaxinfer.engine import scheduler
from jaxinfer.engine.steps import StepCounts

ARCHS = {
    "tiny_dense": presets.get("tiny_dense"),
    "tiny_moe": presets.get("tiny_moe"),
    **{n: dataclasses.replace(
        ModelConfig.from_hf(json.loads((FIXTURES / "hf" / n / "config.json").read_text())),
        max_position_embeddings=512, eos_token_ids=())
       for n in ("llama", "mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2lite", "gpt_oss")},
}
LENGTHS = [1, 9, 40, 200]


def _model(name, seed=0):
  cfg = dataclasses.replace(ARCHS[name], dtype="float32")
  return cfg, models.init_params(cfg, jax.random.key(seed))


# Each attention and FFN form once (CI time): GQA dense, MoE (tiny_moe), MLA +
# MoE from a published config (deepseek_v3), sinks and sliding windows
# (gpt_oss). Llama, Mixtral, Qwen3-MoE and DeepSeek-V2-Lite run the same
# engine paths (llama's rope scaling is the forward's: positions are the
# Engine's); their forwards match transformers in tests/models/test_models.py.
@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "deepseek_v3", "gpt_oss"])
def test_greedy_matches_repeated_full_forward(name):
  cfg, params = _model(name)
  prompts = _prompts(cfg, LENGTHS)
  # Chunk (32) smaller than the prompts; all submitted together.
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=128, max_num_batched_tokens=48,
                                         prefill_chunk_size=32))
  outs = eng.generate(prompts, SamplingParams(max_tokens=5))
  ref = engine.greedy_reference(cfg, params, prompts, 5)
  assert [o.token_ids for o in outs] == ref
  assert all(o.finish_reason == "length" for o in outs)
  _no_leak(eng)


# (CI time: preemption is the scheduler's, the same for every model; the
# recompute is a prefill, each model's in test_greedy_matches_repeated_full_forward.)
@pytest.mark.parametrize("name,async_scheduling", [
    ("tiny_dense", True), ("tiny_dense", False), ("tiny_moe", True)])
def test_preemption_recomputes_and_matches(name, async_scheduling):
  cfg, params = _model(name)
  prompts = _prompts(cfg, [30, 35, 41, 27], seed=1)
  # 4 requests need ~8 pages each at the end; 14 pages force preemption.
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=15, max_num_batched_tokens=64,
                                         async_scheduling=async_scheduling))
  outs = eng.generate(prompts, SamplingParams(max_tokens=24))
  assert eng.stats()["preemptions"] > 0
  assert [o.token_ids for o in outs] == engine.greedy_reference(cfg, params, prompts, 24)
  _no_leak(eng)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_prefix_cache_reuses_prompt_pages(name):
  cfg, params = _model(name)
  prompt = _prompts(cfg, [45], seed=2)[0]
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64))
  first = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
  second = eng.generate([prompt], SamplingParams(max_tokens=4))[0]
  assert first.metrics.cached_prompt_tokens == 0 and first.metrics.computed_prompt_tokens == 45
  assert second.metrics.cached_prompt_tokens == 40  # 5 full pages of 8
  assert second.metrics.computed_prompt_tokens == 5
  assert second.token_ids == first.token_ids
  _no_leak(eng)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_streaming_events_and_stop_tokens(async_scheduling):
  cfg, params = _model("tiny_dense")
  prompt = _prompts(cfg, [12], seed=3)[0]
  greedy = engine.greedy_reference(cfg, params, [prompt], 8)[0]
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64,
                                         async_scheduling=async_scheduling))
  rid = eng.submit(prompt, SamplingParams(max_tokens=8, stop_token_ids=(greedy[3],)))
  streamed, finished = [], False
  while eng.has_unfinished():
    for r, new, fin in eng.step():
      assert r == rid
      streamed += new
      finished = fin
  out = eng.output(rid)
  stop_at = greedy.index(greedy[3]) + 1
  assert finished and out.finish_reason == "stop"
  assert streamed == out.token_ids == greedy[:stop_at]
  assert out.metrics.ttft_s > 0 and out.metrics.generated_tokens == stop_at


def test_eos_from_config_stops_unless_ignored():
  cfg, params = _model("tiny_dense")
  prompt = _prompts(cfg, [6], seed=4)[0]
  greedy = engine.greedy_reference(cfg, params, [prompt], 6)[0]
  cfg_eos = dataclasses.replace(cfg, eos_token_ids=(greedy[1],))
  out = Engine(cfg_eos, params, EngineConfig(num_pages=32)).generate([prompt], SamplingParams(max_tokens=6))[0]
  assert out.finish_reason == "stop" and out.token_ids == greedy[:greedy.index(greedy[1]) + 1]
  out = Engine(cfg_eos, params, EngineConfig(num_pages=32, ignore_eos=True)).generate(
      [prompt], SamplingParams(max_tokens=6))[0]
  assert out.finish_reason == "length" and out.token_ids == greedy


def test_sampling_independent_of_batch_composition():
  cfg, params = _model("tiny_moe")
  prompts = _prompts(cfg, [7, 20, 3], seed=5)
  sp = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
  alone = Engine(cfg, params, EngineConfig(num_pages=64)).generate([prompts[0]], sp)[0]
  others = [SamplingParams(max_tokens=10, temperature=0.7, seed=s) for s in (1, 2)]
  mixed = Engine(cfg, params, EngineConfig(num_pages=64, max_num_batched_tokens=16)).generate(
      [prompts[1], prompts[0], prompts[2]], [others[0], sp, others[1]])
  assert mixed[1].token_ids == alone.token_ids
  other_seed = Engine(cfg, params, EngineConfig(num_pages=64)).generate(
      [prompts[0]], dataclasses.replace(sp, seed=12))[0]
  assert other_seed.token_ids != alone.token_ids


def test_temperature_zero_and_top_k_one_are_greedy():
  cfg, params = _model("tiny_dense")
  prompts = _prompts(cfg, [5, 17], seed=6)
  ref = engine.greedy_reference(cfg, params, prompts, 8)
  eng = Engine(cfg, params, EngineConfig(num_pages=64))
  for sp in (SamplingParams(max_tokens=8, temperature=0.0, seed=3),
             SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3)):
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref


def test_sampled_frequencies_match_softmax():
  cfg = dataclasses.replace(presets.get("tiny_dense", vocab_size=6), dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  params["lm_head"] = params["lm_head"] * 0.05  # a spread-out distribution
  prompt = [1, 2, 3]
  probs = np.asarray(jax.nn.softmax(models.logits(cfg, params, np.array([prompt]))[0, -1]))
  n = 3000
  eng = Engine(cfg, params, EngineConfig(num_pages=n + 1, page_size=4, max_num_seqs=512,
                                         max_num_batched_tokens=2048))
  outs = eng.generate([prompt] * n, [SamplingParams(max_tokens=1, temperature=1.0, seed=s)
                                     for s in range(n)])
  counts = np.bincount([o.token_ids[0] for o in outs], minlength=cfg.vocab_size)
  expected = probs * n
  assert expected.min() > 50  # every cell well populated
  chi2 = float(np.sum((counts - expected) ** 2 / expected))
  assert chi2 < 20.5, (chi2, counts, expected)  # df = 5, p = 0.001


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_frees_pages_and_others_finish(async_scheduling):
  cfg, params = _model("tiny_dense")
  prompts = _prompts(cfg, [30, 30, 30], seed=7)
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, enable_prefix_caching=False,
                                         async_scheduling=async_scheduling))
  ids = [eng.submit(p, SamplingParams(max_tokens=20)) for p in prompts]
  for _ in range(5):  # async: the prompt step, its read, then decodes
    eng.step()
  used = eng.stats()["kv_pages_used"]
  held = len(eng.core.requests[ids[1]].pages)
  assert held >= 8  # 30 prompt tokens and some outputs, 4 per page
  out = eng.abort(ids[1])
  assert out.finish_reason == "abort" and len(out.token_ids) >= 3
  assert eng.stats()["kv_pages_used"] == used - held
  while eng.has_unfinished():
    eng.step()
  ref = engine.greedy_reference(cfg, params, [prompts[0], prompts[2]], 20)
  assert [eng.output(i).token_ids for i in (ids[0], ids[2])] == ref
  _no_leak(eng)
  with pytest.raises(ValueError, match="request_id"):
    eng.abort(99)


def test_recover_after_a_failed_step_ends_its_requests_and_rebuilds_the_pool():
  cfg, params = _model("tiny_dense")
  prompts = _prompts(cfg, [30, 30], seed=3)
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64))
  eng.generate([prompts[0]], SamplingParams(max_tokens=2))  # its pages enter the prefix cache
  assert eng.stats()["kv_pages_cached"] > 0
  ids = [eng.submit(p, SamplingParams(max_tokens=8)) for p in prompts]
  eng.step()
  jax.tree.map(lambda a: a.delete(), eng.pool)  # a step that failed after taking the pool
  assert sorted(eng.recover()) == ids
  assert {eng.output(i).finish_reason for i in ids} == {"error"}
  assert not eng.has_unfinished() and eng.stats()["kv_pages_cached"] == 0
  _no_leak(eng)
  # The rebuilt pool serves as a fresh engine does (no stale prefix-cache hit).
  assert ([o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=4))]
          == engine.greedy_reference(cfg, params, prompts, 4))


@pytest.mark.parametrize("prompt,sampling,exc,match", [
    ([], None, ValueError, "prompt must be a non-empty"),
    ([1, 256], None, ValueError, r"prompt token ids must be in \[0, 256\)"),
    ([-1], None, ValueError, "prompt token ids"),
    ([1.5, 2.0], None, TypeError, "integers"),
    ([1] * 64, None, ValueError, "at or over the context limit"),
    ([1] * 10, "greedy", TypeError, "SamplingParams"),
])
def test_bad_requests_raise_and_others_keep_running(prompt, sampling, exc, match):
  cfg, params = _model("tiny_dense")
  good = _prompts(cfg, [10], seed=8)[0]
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, max_model_len=64))
  rid = eng.submit(good, SamplingParams(max_tokens=6))
  eng.step()
  with pytest.raises(exc, match=match):
    eng.submit(prompt, sampling)
  while eng.has_unfinished():
    eng.step()
  assert eng.output(rid).token_ids == engine.greedy_reference(cfg, params, [good], 6)[0]
  assert eng.stats()["steps"] == 6


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_k=-1), "top_k"),
    # Values the step's int32 / float32 / uint32 arrays cannot hold, and booleans.
    (dict(max_tokens=2**31), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=2**31), "top_k"), (dict(temperature=1e308), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=True), "temperature"),
    (dict(seed=2**32), "seed"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(top_p=float("nan")), "top_p"), (dict(stop_token_ids=(2**40,)), "stop_token_ids"),
])
def test_impossible_sampling_params(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_request_larger_than_pool_and_generate_validates_first():
  cfg, params = _model("tiny_dense")
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=9))  # 8 usable pages
  with pytest.raises(ValueError, match="more than the whole pool"):
    eng.submit([1] * 20, SamplingParams(max_tokens=20))
  with pytest.raises(ValueError, match=r"prompts\[1\]: prompt must be a non-empty"):
    eng.generate([[1, 2], []], SamplingParams(max_tokens=2))
  assert not eng.has_unfinished()  # nothing was queued


def test_context_limit_stops_with_length():
  cfg, params = _model("tiny_dense")
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, max_model_len=20))
  prompt = _prompts(cfg, [15], seed=9)[0]
  out = eng.generate([prompt], SamplingParams(max_tokens=50))[0]
  assert out.finish_reason == "length" and len(out.token_ids) == 5
  assert out.token_ids == engine.greedy_reference(cfg, params, [prompt], 5)[0]


def test_compiled_programs_stay_bounded():
  cfg, params = _model("tiny_moe")
  rng = np.random.default_rng(10)
  lengths = rng.integers(1, 120, 50)
  prompts = _prompts(cfg, lengths, seed=10)
  sampling = [SamplingParams(max_tokens=int(m), temperature=float(t), seed=i)
              for i, (m, t) in enumerate(zip(rng.integers(1, 24, 50), rng.uniform(0, 1, 50)))]
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=160, max_num_seqs=16,
                                         max_num_batched_tokens=128))
  outs = eng.generate(prompts, sampling)
  stats = eng.stats()
  assert all(o.finish_reason == "length" for o in outs)
  assert stats["steps"] > 40
  # Buckets: tokens 1..128 (8), seqs 1..16 (5), pages 1..256 (9), max_q (8); a
  # run touches a handful of combinations, never one per step.
  assert stats["compiles"] <= 24, stats
  assert stats["compiles"] < stats["steps"] / 2
  _no_leak(eng)


def test_page_bucket_is_the_smallest_power_of_two_or_one_and_a_half_times_one():
  sizes = sorted({1 << k for k in range(14)} | {3 << k for k in range(13)})
  for cap in (5, 12, 100, 4096):
    for n in range(1, cap + 1):
      b = steps.page_bucket(n, cap)
      assert b == min(min(s for s in sizes if s >= n), cap), (n, cap, b)
  assert steps.page_bucket(130, 100) == 130  # over the cap: as asked (the caller checks)


def test_async_overlaps_steps_and_matches_sync():
  cfg, params = _model("tiny_moe")
  prompts = _prompts(cfg, [3, 50, 17, 90, 8], seed=12)
  sampling = [SamplingParams(max_tokens=12, temperature=t, seed=i, stop_token_ids=(7,))
              for i, t in enumerate([0.0, 0.9, 0.5, 0.0, 1.0])]
  runs = {}
  for mode in (True, False):
    eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, max_num_batched_tokens=32,
                                           async_scheduling=mode))
    runs[mode] = ([o.token_ids for o in eng.generate(prompts, sampling)], eng.stats())
    _no_leak(eng)
  assert runs[True][0] == runs[False][0]
  # Async: steps were dispatched while the previous one was in flight.
  assert runs[True][1]["overlapped_steps"] > 0 and runs[False][1]["overlapped_steps"] == 0


# MLA + MoE with split experts (CI time: GQA with sinks and windows in every
# CPU layout is tests/models/test_models.py::test_step_layout_equals_stacked's,
# and gpt_oss's unrolled Engine test_unrolled_engine_holds_one_copy_of_the_weights).
@pytest.mark.parametrize("name", ["tiny_moe"])
def test_unrolled_step_layout_matches_scanned(name):
  """EngineConfig(unroll_layers=True) (per-layer weights in the step layout,
  experts split) and the scanned stacked layers: same greedy tokens and the
  same routed-expert counts, over chunked prefill, decode and prefix hits."""
  cfg, params = _model(name, seed=2)
  prompts = _prompts(cfg, [3, 37, 70, 37], seed=4)
  prompts[3] = prompts[1][:32] + prompts[3][:5]  # shares two pages with prompt 1
  outs, loads = [], []
  # Two CPU weight layouts (CI time; every layout: test_step_layout_equals_stacked).
  layouts = ("in_out", "panels")
  for unroll, layout in ((False, "auto"), *((True, lay) for lay in layouts)):
    eng = Engine(cfg, params, EngineConfig(num_pages=64, max_num_batched_tokens=32,
                                           unroll_layers=unroll, cpu_weight_layout=layout))
    outs.append([o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=9))])
    loads.append(eng.expert_load())
    _no_leak(eng)
  assert outs[0] == outs[1] == outs[2]
  for load in loads[1:]:
    np.testing.assert_array_equal(loads[0], load)


@pytest.mark.parametrize("name", ["gpt_oss"])  # (CI time: one model; its layers are MoE)
def test_unrolled_engine_holds_one_copy_of_the_weights(name):
  """With unroll_layers the engine keeps only the step layout: the device
  memory it holds is the weights' bytes once plus its KV pool, and
  `engine.params` rebuilds the stacked tree bit for bit."""
  import gc
  cfg, params = _model(name, seed=3)
  host = jax.device_get(params)
  del params
  weight_bytes = sum(w.nbytes for w in jax.tree.leaves(host))

  def live_bytes():
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())

  base = live_bytes()
  eng = Engine(cfg, jax.tree.map(jax.numpy.asarray, host),  # the only copy on the device
               EngineConfig(num_pages=16, max_num_batched_tokens=32, unroll_layers=True))
  held = live_bytes() - base - sum(a.nbytes for a in jax.tree.leaves(eng.pool))
  assert weight_bytes <= held < weight_bytes * 1.02, (held, weight_bytes)
  got = eng.params
  assert jax.tree.structure(got) == jax.tree.structure(host)
  for want, leaf in zip(jax.tree.leaves(host), jax.tree.leaves(got)):
    np.testing.assert_array_equal(leaf, want)
  del got
  prompts = _prompts(cfg, [5, 40], seed=1)
  want = engine.greedy_reference(cfg, host, prompts, 4)
  assert [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=4))] == \
      [list(w) for w in want]


def _dp_core(policy, ranks=4, budget=128):
  """An engine core (host only) with `ranks` attention-DP schedulers."""
  from jaxinfer.engine.core import HostCore
  return HostCore(EngineConfig(page_size=16, num_pages=64, max_num_seqs=4,
                               max_num_batched_tokens=budget, dp_balance=policy,
                               dp_min_step_tokens=16),
                  num_ranks=ranks, num_pages=64, max_model_len=1024, vocab_size=256, eos_ids=())


@pytest.mark.parametrize("policy", ["split", "none"])
def test_dp_balance_splits_a_lone_prefill(policy):
  core = _dp_core(policy)
  long_id = core.submit(list(range(1, 201)))  # 200 tokens on one rank
  for _ in range(3):  # short prompts on the three others (least-loaded ranks)
    core.submit([5, 6, 7])
  assert sorted(r.rank for r in core.requests.values()) == [0, 1, 2, 3]
  per_rank = scheduler.schedule_ranks(core.schedulers, [0] * 4, core.config)
  long_rank = core.requests[long_id].rank
  chunk = sum(s.num_tokens for s in per_rank[long_rank])
  others = max(sum(s.num_tokens for s in sch) for r, sch in enumerate(per_rank) if r != long_rank)
  assert others == 3
  # split: the step budget follows what most ranks run (at least 16); none: 128.
  assert chunk == (16 if policy == "split" else 128)
  # Every rank prefilling: nothing is capped.
  busy = _dp_core(policy)
  for _ in range(4):
    busy.submit(list(range(1, 201)))
  per_rank = scheduler.schedule_ranks(busy.schedulers, [0] * 4, busy.config)
  assert all(sum(s.num_tokens for s in sch) == 128 for sch in per_rank)
  with pytest.raises(ValueError, match="dp_balance must be one of"):
    EngineConfig(dp_balance="even")


def test_cpu_weight_layout_auto_reads_the_probe_and_small_models_skip_it(monkeypatch, tmp_path):
  from jaxinfer.engine import weight_layout
  monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))  # no probe on disk yet
  tiny = presets.get("tiny_dense")
  before = weight_layout.measure.cache_info().misses
  assert weight_layout.resolve(tiny, "auto") == "in_out"  # weights in cache: no timing
  assert weight_layout.resolve(tiny, "out_in") == "out_in"
  assert weight_layout.resolve(tiny, "out_major") == "out_major"
  assert weight_layout.resolve(tiny, "panels") == "panels"  # the C++ kernels may build here
  big = presets.get("bench_dense")
  assert weight_layout.resolve(big, "auto") == weight_layout.UNPROBED  # no probe: no timing
  assert weight_layout.measure.cache_info().misses == before
  probe = weight_layout.probe(big)  # the explicit probe: builds the kernels, times, keeps it
  got = weight_layout.resolve(big, "auto")
  layouts = ("in_out", "out_in", "out_major", "panels")  # panels: the native kernels build here
  assert got == probe["layout"] in layouts
  for layout in layouts:
    assert sorted(probe["ms"][layout]) == list(weight_layout.PROBE_ROWS)
    assert all(ms > 0 for ms in probe["ms"][layout].values())
  mean = {k: np.prod([probe["ms"][k][r] for r in weight_layout.PROBE_ROWS]) for k in layouts}
  assert mean[got] == min(mean.values())
  with pytest.raises(ValueError, match="cpu_weight_layout must be one of"):
    EngineConfig(cpu_weight_layout="rows")


def test_host_time_per_step_counts_compiled_programs_only():
  """stats()["host_ms_per_step"]: host time of building and dispatching a
  step, over the steps whose program was compiled already."""
  counts = StepCounts()
  counts.record("a", 4, False, 5.0)  # a's first step: it compiles, not counted
  counts.record("a", 4, True, 0.002)
  counts.record("b", 1, True, 3.0)
  counts.record("a", 4, True, 0.004)
  assert (counts.steps, counts.host_steps) == (4, 2) and abs(counts.host_s - 0.006) < 1e-12
  cfg, params = _model("tiny_dense")
  eng = Engine(cfg, params, EngineConfig(num_pages=32))
  eng.generate(_prompts(cfg, [5, 9]), SamplingParams(max_tokens=8))
  stats = eng.stats()
  assert 0 < stats["host_ms_per_step"] < 1e3 and stats["steps"] > stats["compiles"]
