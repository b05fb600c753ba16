"""Cluster simulator: the real scheduler and router over modelled step times."""

import dataclasses
import math

import numpy as np
import pytest

from jaxinfer import EngineConfig, MTPConfig, models, presets
from jaxinfer.serving import workloads
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.sim.cost import (CalibratedCost, Parallelism, RooflineCost, StepShape,
                               cost_per_million_tokens, device, param_counts)
from jaxinfer.sim.engine import WorkerSpec, check_acceptance
from jaxinfer.sim.simulator import Simulator

# 5 ms a step plus 0.1 ms a token: a CPU-like engine.
COST = CalibratedCost(features=("const", "tokens"), coef=(5e-3, 1e-4), max_model_len=4096)
CONFIG = EngineConfig(page_size=16, num_pages=256, max_num_seqs=8, max_num_batched_tokens=64)


def _items(n=30, rate=50.0, max_tokens=12, seed=0):
  return workloads.independent(n, rate, vocab_size=1000, min_len=8, max_len=120,
                               max_tokens=max_tokens, seed=seed)


def _mtp_spec(k, acceptance, **kw):
  config = dataclasses.replace(CONFIG, speculative=MTPConfig(num_draft_tokens=k,
                                                             batch_schedule=()))
  return WorkerSpec(cost=COST, config=config, acceptance=acceptance, **kw)


@pytest.mark.parametrize("concurrency", [None, 5])
def test_every_request_completes_once_with_its_tokens(concurrency):
  rng = np.random.default_rng(0)
  items = [dataclasses.replace(it, max_tokens=int(rng.integers(1, 20))) for it in _items()]
  sim = Simulator([WorkerSpec(cost=COST, config=CONFIG)] * 2, router="kv")
  res = sim.run(items, concurrency=concurrency)
  assert [r.index for r in res.requests] == list(range(len(items)))
  assert [r.tokens for r in res.requests] == [it.max_tokens for it in items]
  for r in res.requests:
    assert r.arrival_s <= r.first_token_s <= r.finish_s
  s = res.summary(window=None)
  assert s["completed"] == len(items)
  assert s["output_tokens"] == sum(it.max_tokens for it in items)


def test_tight_pool_preempts_and_still_completes():
  tight = dataclasses.replace(CONFIG, num_pages=24)  # 23 pages of 16 for 8 sequences
  res = Simulator([WorkerSpec(cost=COST, config=tight)]).run(_items(n=20, rate=math.inf,
                                                                    max_tokens=40))
  assert all(r.tokens == 40 for r in res.requests)


def test_roofline_batch1_decode_is_weight_bytes_over_bandwidth():
  cfg = presets.get("llama3_8b")
  dev = device("h100")
  cost = RooflineCost(cfg=cfg, device=dev, weight_dtype="bf16", layer_floor_s=0.0,
                      step_overhead_s=0.0)
  # Every weight but the embedding table is read once per decode step.
  embed = cfg.vocab_size * cfg.d_model
  weight_bytes = (models.count_params(cfg) - embed) * 2
  kv = 1000 * cost.kv_bytes_per_token()
  t = cost.step_time([StepShape(decode_seqs=1, kv_read_tokens=1000, pairs_decode=1000)])
  expected = (weight_bytes + kv) / (dev.hbm_bw * dev.bw_eff)
  assert t.seconds == pytest.approx(expected, rel=0.01)
  assert sum(t.parts.values()) == pytest.approx(t.seconds)


def test_roofline_moe_reads_only_touched_experts_at_batch1():
  cfg = presets.get("deepseek_v3")
  c = param_counts(cfg)
  cost = RooflineCost(cfg=cfg, device=device("gb300"), layer_floor_s=0.0, step_overhead_s=0.0)
  t = cost.step_time([StepShape(decode_seqs=1, kv_read_tokens=1, pairs_decode=1)])
  bw = cost.device.hbm_bw * cost.device.bw_eff
  k = cfg.num_experts_per_tok
  assert t.parts["experts"] == pytest.approx(k * c.expert * c.moe_layers / bw, rel=1e-6)


def test_deepseek_does_not_fit_eight_h100():
  cost = RooflineCost(cfg=presets.get("deepseek_v3"), device=device("h100"),
                      par=Parallelism(dp=8, ep=8))
  with pytest.raises(ValueError, match="does not fit h100"):
    cost.kv_pages(64)


def test_calibrated_cost_recovers_coefficients():
  rng = np.random.default_rng(0)
  true = dict(const=2e-3, tokens=5e-5, seqs=3e-4, padded_kv=1e-7)
  samples = []
  for _ in range(60):
    s = StepShape(prefill_tokens=int(rng.integers(0, 64)), prefill_seqs=1,
                  decode_seqs=int(rng.integers(0, 8)), padded_seqs=8,
                  padded_pages=int(2 ** rng.integers(0, 6)), page_size=16)
    t = (true["const"] + true["tokens"] * s.tokens + true["seqs"] * s.seqs
         + true["padded_kv"] * s.padded_seqs * s.padded_pages * 16)
    samples.append((s, t))
  fit = CalibratedCost.fit(samples, tuple(true))
  np.testing.assert_allclose(fit.coef, list(true.values()), rtol=1e-6)


def test_nnls_keeps_coefficients_non_negative():
  rng = np.random.default_rng(1)
  samples = [(StepShape(decode_seqs=int(n)), 1e-3 + 1e-4 * n - 1e-6 * n * n)
             for n in rng.integers(1, 50, 40)]
  fit = CalibratedCost.fit(samples, ("const", "decode_seqs", "tokens"))
  assert min(fit.coef) >= 0


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_full_acceptance_emits_k_plus_one_per_step(k):
  res = Simulator([_mtp_spec(k, (1.0,) * k)]).run(_items(max_tokens=41))
  why = res.summary(window=None)["why"]["mixed"]
  assert why["tokens_per_decode_row"] == pytest.approx(k + 1, rel=0.05)
  assert all(r.tokens == 41 for r in res.requests)


def test_mtp_acceptance_sets_mean_tokens_per_step():
  acc = (0.8, 0.5)
  res = Simulator([_mtp_spec(2, acc)]).run(_items(n=40, max_tokens=200))
  why = res.summary(window=None)["why"]["mixed"]
  assert why["tokens_per_decode_row"] == pytest.approx(1 + sum(acc), rel=0.05)


def test_kv_routing_hits_more_prefix_cache_than_round_robin():
  # 16 system prompts of 256 tokens: more than one worker's 255 pages
  # hold, so round-robin keeps evicting; KV routing gives each worker its share.
  items = workloads.shared_system_prompt(120, 40.0, vocab_size=1000, num_system_prompts=16,
                                         system_len=256, user_min=8, user_max=32,
                                         max_tokens=4, seed=0)
  hit = {}
  for policy in ("kv", "round_robin"):
    res = Simulator([WorkerSpec(cost=COST, config=CONFIG)] * 4, router=policy).run(items)
    hit[policy] = res.summary(window=None)["prefix_hit_rate"]
  assert hit["kv"] > hit["round_robin"] + 0.1, hit


def test_disaggregated_decode_steps_carry_no_prefill():
  specs = [WorkerSpec(cost=COST, config=CONFIG, role="prefill"),
           WorkerSpec(cost=COST, config=CONFIG, role="decode")]
  items = _items()
  res = Simulator(specs, disagg=DisaggConfig(mode="always")).run(items)
  s = res.summary(window=None)
  assert s["remote_prefills"] == len(items)
  assert set(s["why"]["decode"]["kinds"]) == {"decode"}
  assert set(s["why"]["prefill"]["kinds"]) == {"prefill"}
  assert [r.tokens for r in res.requests] == [it.max_tokens for it in items]
  assert all(r.prefill_worker == 0 and r.worker == 1 for r in res.requests)


def test_conditional_disaggregation_keeps_short_prompts_local():
  specs = [WorkerSpec(cost=COST, config=CONFIG, role="prefill"),
           WorkerSpec(cost=COST, config=CONFIG, role="decode")]
  res = Simulator(specs, disagg=DisaggConfig(max_local_prefill_length=64,
                                             max_prefill_queue_size=100)).run(_items())
  remote = [r.prompt_tokens for r in res.requests if r.prefill_worker >= 0]
  local = [r.prompt_tokens for r in res.requests if r.prefill_worker < 0]
  assert remote and local and min(remote) > 64 >= max(local)


def test_attention_dp_token_balance_beats_round_robin():
  # Attention work follows the K/V each rank reads; the engine's rank choice
  # balances pending tokens + K/V held, round-robin only request counts.
  cost = CalibratedCost(features=("const", "kv_read_tokens"), coef=(1e-3, 1e-5),
                        max_model_len=4096)
  rng = np.random.default_rng(0)
  items = [workloads.Item(0.0, tuple(range(int(n))), 30) for n in rng.choice([8, 500], 32)]
  balance = {}
  for policy in ("tokens", "round_robin"):
    spec = WorkerSpec(cost=cost, config=dataclasses.replace(CONFIG, num_pages=512), ranks=4,
                      rank_policy=policy)
    res = Simulator([spec]).run(items, concurrency=16)
    balance[policy] = res.summary(window=None)["why"]["mixed"]["attn_dp_balance"]
  assert balance["tokens"] > balance["round_robin"], balance


def test_same_seed_same_result_other_seed_differs():
  run = lambda seed: [(r.first_token_s, r.finish_s) for r in Simulator(
      [_mtp_spec(3, (0.7, 0.5, 0.3))], seed=seed).run(_items(max_tokens=30)).requests]
  assert run(0) == run(0)
  assert run(0) != run(1)


def test_cost_per_million_tokens():
  # 8 GPUs at $3/h serving 1000 tokens/s: $24/h over 3.6M tokens.
  assert cost_per_million_tokens(price_per_gpu_hour=3.0, gpus=8,
                                 tokens_per_s=1000) == pytest.approx(24 / 3.6)


def test_bad_inputs_raise_value_errors_naming_the_problem():
  with pytest.raises(ValueError, match="unknown device 'tpu9'"):
    device("tpu9")
  with pytest.raises(ValueError, match="num_draft_tokens"):
    MTPConfig(num_draft_tokens=-1)
  with pytest.raises(ValueError, match=r"acceptance values must be in \[0, 1\]"):
    check_acceptance((1.2,))
  with pytest.raises(ValueError, match="non-increasing"):
    check_acceptance((0.5, 0.9))
  with pytest.raises(ValueError, match="2 positions for 3 MTP draft tokens"):
    _mtp_spec(3, (0.9, 0.8))
  with pytest.raises(ValueError, match="rate must be > 0"):
    workloads.poisson_times(4, -1.0)
  with pytest.raises(ValueError, match="price_per_gpu_hour"):
    cost_per_million_tokens(price_per_gpu_hour=-1.0, gpus=8, tokens_per_s=1.0)
  with pytest.raises(ValueError, match="ep=3 must divide"):
    Parallelism(dp=4, ep=3)
  with pytest.raises(ValueError, match="weight_dtype"):
    RooflineCost(cfg=presets.get("llama3_8b"), device=device("h100"), weight_dtype="int3")
  with pytest.raises(ValueError, match="concurrency"):
    Simulator([WorkerSpec(cost=COST, config=CONFIG)]).run(_items(), concurrency=0)
  with pytest.raises(ValueError, match="role"):
    WorkerSpec(cost=COST, role="verifier")
  long = [workloads.Item(0.0, tuple(range(4000)), 200)]
  with pytest.raises(ValueError, match=r"items\[0\].*KV pages"):
    Simulator([WorkerSpec(cost=COST, config=CONFIG)]).run(long)


def test_measured_steps_and_simulated_steps_match_the_real_engine():
  # A burst runs the same schedule in the engine and in the simulator (the
  # same Scheduler, no timing in the loop): equal step counts and tokens.
  from jaxinfer.serving.cluster import Cluster
  from benchlib.sim_calibration import measure_steps
  from jaxinfer.serving.worker import Worker
  import jax
  cfg = presets.get("tiny_dense", num_layers=1, dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  # One page per sequence: a single compiled program.
  ec = EngineConfig(page_size=32, num_pages=16, max_num_seqs=4, max_num_batched_tokens=16,
                    fixed_step_shapes=True, async_scheduling=False, ignore_eos=True)
  items = workloads.independent(6, math.inf, vocab_size=cfg.vocab_size, min_len=4, max_len=20,
                                max_tokens=5, seed=0)
  cluster = Cluster([Worker(cfg, params, ec)], router="round_robin")
  samples, outs, wall = measure_steps(cluster, items)
  steps = cluster.workers[0].engine.stats()["steps"]
  assert len(samples) == steps - 1  # every step but the first has a period before it
  assert all(t > 0 and s.tokens > 0 for s, t in samples)
  assert sum(len(o.token_ids) for o in outs) == 30
  fit = CalibratedCost.fit(samples, ("const",), max_model_len=cfg.max_position_embeddings)
  res = Simulator([WorkerSpec(cost=fit, config=ec)]).run(items)
  assert res.summary(window=None)["why"]["mixed"]["steps"] == steps
  assert [r.tokens for r in res.requests] == [len(o.token_ids) for o in outs]


def test_unsimulated_ranks_make_every_rank_wait_for_prefill_somewhere():
  # One simulated rank of a 32-rank instance: the 31 others are bootstrapped
  # from its recent steps, so steps with a prefill chunk on some rank (and
  # their cost) become far more common than on the one rank alone.
  cost = CalibratedCost(features=("const", "prefill_tokens"), coef=(2e-3, 1e-4),
                        max_model_len=4096)
  items = _items(n=40, rate=math.inf, max_tokens=60)
  share, step = {}, {}
  for n in (1, 32):
    res = Simulator([WorkerSpec(cost=cost, config=CONFIG, instance_ranks=n)],
                    seed=0).run(items, concurrency=4)
    why = res.summary(window=None)["why"]["mixed"]
    share[n] = why["kinds"].get("mixed", {}).get("share", 0.0)
    step[n] = why["mean_step_ms"]
    assert [r.tokens for r in res.requests] == [60] * 40
  assert share[32] > 2 * share[1] and step[32] > step[1], (share, step)
  with pytest.raises(ValueError, match="instance_ranks"):
    WorkerSpec(cost=cost, ranks=4, instance_ranks=2)


def test_simulator_runs_the_engines_dp_balance_policy():
  # The simulated instance schedules with the engine's own per-step DP
  # budgets: "split" cuts the lone long prompt's chunks to the other ranks'
  # step, so mixed steps are better balanced across the ranks than "none".
  cost = CalibratedCost(features=("const", "kv_read_tokens"), coef=(1e-3, 1e-5),
                        max_model_len=4096)
  items = [workloads.Item(0.01 * i, tuple(range(1, 1 + (600 if i % 8 == 0 else 8))), 20)
           for i in range(32)]
  balance = {}
  for policy in ("none", "split"):
    config = dataclasses.replace(CONFIG, num_pages=512, max_num_batched_tokens=256,
                                 dp_balance=policy, dp_min_step_tokens=16)
    res = Simulator([WorkerSpec(cost=cost, config=config, ranks=4)], seed=0).run(items)
    assert all(r.finish_s is not None for r in res.requests)
    balance[policy] = res.summary(window=None)["why"]["mixed"]["kinds"]["mixed"]["attn_dp_balance"]
  assert balance["split"] > balance["none"], balance
