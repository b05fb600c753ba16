"""Serving: disaggregated prefill/decode across sub-meshes with different
layouts, page accounting under aborts and transfer timeouts, routing,
worker faults and the bounded queue."""

import dataclasses
import gc
import weakref

import jax
import numpy as np
import pytest

from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.serving import workloads
from jaxinfer.serving.cluster import Cluster, QueueFull
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.serving.worker import Worker

MODELS = {  # head counts divisible by the 4-way tensor axis of the prefill side
    "dense": presets.get("tiny_dense", num_heads=8, num_kv_heads=8, head_dim=16, num_layers=2),
    "gqa_moe": dataclasses.replace(
        presets.get("tiny_dense", num_heads=16, num_kv_heads=8, head_dim=16, num_layers=2,
                    model_type="qwen3_moe"),
        qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_ffn_dim=64, dense_layers=(0,)),
    "mla_moe": presets.get("tiny_moe", num_experts=8, n_group=2, topk_group=1, num_heads=8,
                           num_kv_heads=8, num_layers=2, num_mtp_layers=0),
}
CONFIG = dict(page_size=4, num_pages=48, max_num_seqs=4, max_num_batched_tokens=32)


def _model(name):
  cfg = dataclasses.replace(MODELS[name], dtype="float32")
  return cfg, models.init_params(cfg, jax.random.key(0))


def _prompts(cfg, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def _no_leak(worker):
  for a in worker.engine.allocators:
    a.check_consistency()
    assert a.num_used() == 0, worker


def _disagg_cluster(cfg, params, **disagg):
  devices = jax.devices()
  prefill = Worker(cfg, params, EngineConfig(**CONFIG), role="prefill", devices=devices[:4],
                   mesh_axes={"tensor": 4}, layout="tp", name="prefill")
  decode = Worker(cfg, params, EngineConfig(**CONFIG), role="decode", devices=devices[4:8],
                  mesh_axes={"data": 2, "expert": 2}, layout="dp_attn_ep", name="decode")
  return Cluster([prefill, decode], disagg=DisaggConfig(mode="always", **disagg))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_disaggregated_greedy_equals_one_engine(name):
  # Prefill tensor-parallel on devices 0-3, decode attention-DP on 4-7: the
  # prompt K/V changes layout on its way (heads split -> pages split).
  cfg, params = _model(name)
  prompts = _prompts(cfg, [3, 17, 9, 30])
  sampling = SamplingParams(max_tokens=6)
  ref = Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sampling)
  cluster = _disagg_cluster(cfg, params)
  outs = cluster.generate(prompts, sampling)
  assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
  assert all(o.prefill_worker == 0 and o.worker == 1 for o in outs)
  assert cluster.stats()["remote_prefills"] == len(prompts)
  for w in cluster.workers:
    _no_leak(w)


def test_no_page_leaks_after_aborts_and_transfer_timeouts():
  cfg, params = _model("mla_moe")
  prompts = _prompts(cfg, [5, 21, 13, 8, 26, 11], seed=1)
  sampling = SamplingParams(max_tokens=8)
  ref = Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sampling)
  cluster = _disagg_cluster(cfg, params, transfer_timeout_s=0.0)
  cluster.stall_transfers(2)  # the first two transfers never land and time out
  cids = [cluster.submit(p, sampling) for p in prompts]
  cluster.abort(cids[5])  # aborted while its prefill is queued
  aborted_mid_decode = None
  while cluster.has_unfinished():
    cluster.step()
    out = cluster.output(cids[4])
    if aborted_mid_decode is None and len(out.token_ids) >= 3:
      aborted_mid_decode = cluster.abort(cids[4])
  outs = [cluster.output(c) for c in cids]
  assert [o.finish_reason for o in outs] == ["length"] * 4 + ["abort"] * 2
  assert [o.token_ids for o in outs[:4]] == [r.token_ids for r in ref[:4]]
  assert outs[4].token_ids == ref[4].token_ids[:len(outs[4].token_ids)]
  assert sum(o.retries for o in outs) == 2  # retried after the timeouts, not lost
  for w in cluster.workers:
    _no_leak(w)


def test_conditional_disaggregation_rule():
  rule = DisaggConfig(max_local_prefill_length=100, max_prefill_queue_size=2)
  assert rule.remote(101, 0) and not rule.remote(100, 0) and not rule.remote(500, 2)
  assert DisaggConfig(mode="always").remote(1, 9) and not DisaggConfig(mode="never").remote(9e9, 0)
  with pytest.raises(ValueError, match="mode"):
    DisaggConfig(mode="sometimes")


def _mixed_cluster(cfg, params, n=4, router="kv", **kw):
  workers = [Worker(cfg, params, EngineConfig(**dict(CONFIG, num_pages=96)), name=f"w{i}")
             for i in range(n)]
  return Cluster(workers, router=router, **kw)


def test_kv_routing_follows_shared_prefixes_with_identical_outputs():
  cfg, params = _model("dense")
  # 3 conversations x 4 turns over 4 workers, served one request at a time
  # in arrival order (round-robin sends a conversation's turns to different
  # workers; KV-aware routing follows the prefix).
  items = workloads.multi_turn(3, 4, 50.0, vocab_size=cfg.vocab_size, system_len=8, user_len=6,
                               reply_len=4, think_s=1.0, max_tokens=4, seed=0)
  outs = {}
  for policy in ("kv", "round_robin"):
    cluster = _mixed_cluster(cfg, params, router=policy)
    served = []
    for it in items:
      served.append(cluster.generate([list(it.prompt)], SamplingParams(max_tokens=4))[0])
    outs[policy] = (served, cluster.stats())
  kv, rr = outs["kv"], outs["round_robin"]
  assert [o.token_ids for o in kv[0]] == [o.token_ids for o in rr[0]]
  assert kv[1]["prefix_hit_rate"] > rr[1]["prefix_hit_rate"] + 0.2, (kv[1], rr[1])


def test_balanced_load_without_shared_prefixes():
  cfg, params = _model("dense")
  items = workloads.independent(48, 1e9, vocab_size=cfg.vocab_size, min_len=4, max_len=24,
                                max_tokens=2, seed=3)
  cluster = _mixed_cluster(cfg, params, router="kv")
  cluster.generate([list(it.prompt) for it in items], SamplingParams(max_tokens=2))
  per_worker = np.asarray(cluster.stats()["requests_per_worker"])
  assert per_worker.max() / per_worker.mean() <= 1.2, per_worker


@pytest.mark.parametrize("fault", ["stop", "raise"])
def test_stopping_a_worker_mid_run_loses_nothing(fault):
  cfg, params = _model("dense")
  prompts = _prompts(cfg, [6, 11, 3, 19, 8, 14, 5, 9], seed=2)
  sampling = SamplingParams(max_tokens=10)
  ref = Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sampling)
  cluster = _mixed_cluster(cfg, params, router="round_robin")
  if fault == "raise":
    cluster.workers[1].fail_after(3)
  cids = [cluster.submit(p, sampling) for p in prompts]
  steps = 0
  while cluster.has_unfinished():
    if cluster.workers[1].alive:  # its KV pool when it stops
      pool = [weakref.ref(x) for x in jax.tree.leaves(cluster.workers[1].engine.pool)]
    cluster.step()
    steps += 1
    if fault == "stop" and steps == 3:
      cluster.stop_worker(1, "maintenance")
  outs = [cluster.output(c) for c in cids]
  assert not cluster.workers[1].alive
  gc.collect()  # a stopped worker keeps no device memory, and its engine says so
  assert pool and not any(r() is not None for r in pool)
  with pytest.raises(RuntimeError, match="released"):
    cluster.workers[1].engine.submit([1, 2, 3])
  # Every request completed exactly once, with the tokens of an undisturbed run.
  assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
  assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
  assert sum(o.reroutes for o in outs) >= 2 and all(o.worker != 1 for o in outs)
  for w in (cluster.workers[0], *cluster.workers[2:]):
    _no_leak(w)


def test_every_request_ends_with_tokens_or_an_error_when_all_workers_stop():
  cfg, params = _model("dense")
  cluster = _mixed_cluster(cfg, params, n=2)
  cids = [cluster.submit(p, SamplingParams(max_tokens=20)) for p in _prompts(cfg, [4, 7, 5])]
  cluster.step()
  cluster.stop_worker(0)
  cluster.stop_worker(1)
  outs = [cluster.output(c) for c in cids]
  assert not cluster.has_unfinished()
  assert all(o.finish_reason == "error" and "no live worker" in o.error for o in outs)
  with pytest.raises(RuntimeError, match="no live worker"):
    cluster.submit([1, 2, 3])


def test_bounded_queue_rejects_with_a_clear_error():
  cfg, params = _model("dense")
  cluster = _mixed_cluster(cfg, params, n=1, max_queue=2)
  cluster.submit([1, 2, 3], SamplingParams(max_tokens=2))
  cluster.submit([4, 5, 6], SamplingParams(max_tokens=2))
  with pytest.raises(QueueFull, match="max_queue=2"):
    cluster.submit([7, 8, 9], SamplingParams(max_tokens=2))
  with pytest.raises(ValueError, match="out of|must be in"):
    cluster.submit([cfg.vocab_size], SamplingParams(max_tokens=2))
  items = [workloads.Item(arrival_s=0.0, prompt=(1, 2, 3, k), max_tokens=2) for k in range(4)]
  outs = cluster.run(items)
  rejected = [o for o in outs if o.finish_reason == "error"]
  assert rejected and all("rejected" in o.error and "max_queue" in o.error for o in rejected)
  assert all(o.finish_reason == "length" for o in outs if o not in rejected)


def test_workers_added_after_a_stop_pair_with_the_live_workers_only():
  # A stopped worker has released its engine: the compatibility checks of a
  # new worker skip it, and the new pairs serve with the reference tokens.
  cfg, params = _model("dense")
  prompts = _prompts(cfg, [6, 11, 3], seed=4)
  sampling = SamplingParams(max_tokens=6)
  ref = Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sampling)
  worker = lambda role, name: Worker(cfg, params, EngineConfig(**CONFIG), role=role, name=name)
  cluster = Cluster([worker("prefill", "p0"), worker("decode", "d0")],
                    disagg=DisaggConfig(mode="always"))
  cluster.stop_worker(0)
  cluster.add_worker(worker("prefill", "p1"))
  cluster.stop_worker(1)
  cluster.add_worker(worker("decode", "d1"))
  cids = [cluster.submit(p, sampling) for p in prompts]
  while cluster.has_unfinished():
    cluster.step()
  assert [cluster.output(c).token_ids for c in cids] == [r.token_ids for r in ref]
  assert cluster.stats()["remote_prefills"] == len(prompts)
