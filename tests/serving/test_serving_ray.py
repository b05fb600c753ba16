"""Serving on Ray: workers as actors in processes of their own (a local Ray
started here, 2 CPUs), KV pages handed between processes, a worker process
killed mid-run, a worker spanning two processes (a `jax.distributed` group).
Every answer is compared with one in-process Engine."""

import dataclasses
import os
import signal
import time

import jax
import numpy as np
import pytest
import ray

from jaxinfer import Engine, EngineConfig, SamplingParams, load_default_model, models, presets
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.serving.ray_cluster import RayCluster, measure_transfer
from jaxinfer.serving.ray_worker import WorkerSpec, host_tree
from conftest import TEST_ENV

CFG = dataclasses.replace(presets.get("tiny_dense"), dtype="float32")
CONFIG = EngineConfig(page_size=4, num_pages=48, max_num_seqs=4, max_num_batched_tokens=32)
ENV = {"JAX_PLATFORMS": "cpu", **TEST_ENV}  # one CPU device per worker process


@pytest.fixture(scope="module")
def params_ref():
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  params = models.init_params(CFG, jax.random.key(0))
  yield params, ray.put(host_tree(params))
  ray.shutdown()


def _specs(ref, roles):
  return [WorkerSpec(model=CFG, params=ref, config=CONFIG, role=r, name=f"{r}{k}",
                     num_cpus=0.5, env=ENV) for k, r in enumerate(roles)]


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def _pages_in_use(cluster):
  cluster.step()  # answers after every release sent before it
  return [w.load()["decode_pages"] for w in cluster.workers if w.alive]


def test_two_ray_workers_equal_one_engine(params_ref):
  params, ref = params_ref
  prompts = _prompts([3, 17, 9, 30, 5, 12])
  sampling = SamplingParams(max_tokens=6)
  want = [o.token_ids for o in Engine(CFG, params, CONFIG).generate(prompts, sampling)]
  cluster = Cluster(_specs(ref, ["mixed", "mixed"]), backend="ray", router="round_robin",
                    step_timeout_s=90)
  try:
    assert isinstance(cluster, RayCluster)
    pids = cluster.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids  # a process each
    outs = cluster.generate(prompts, sampling)
    assert [o.token_ids for o in outs] == want
    assert {o.finish_reason for o in outs} == {"length"}
    assert cluster.stats()["requests_per_worker"] == [3, 3]
    assert [w.engine.stats()["prompt_tokens"] for w in cluster.workers] == [3 + 9 + 5,
                                                                             17 + 30 + 12]
    assert _pages_in_use(cluster) == [0, 0]
  finally:
    cluster.shutdown()


@pytest.mark.parametrize("kv_transport,model", [("jax", "default"), ("object_store", "tiny")])
def test_disaggregated_across_processes_and_transfer_timeout(params_ref, kv_transport, model):
  # "default": the bundled MLA + MoE model, loaded in each worker process.
  params, ref = params_ref
  cfg = CFG
  specs = _specs(ref, ["prefill", "decode"])
  if model == "default":
    cfg, params, _ = load_default_model()
    specs = [dataclasses.replace(s, model="default", params=None) for s in specs]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in [3, 17, 9, 30]]
  sampling = SamplingParams(max_tokens=6)
  want = [o.token_ids for o in Engine(cfg, params, CONFIG).generate(prompts, sampling)]
  cluster = Cluster(specs, backend="ray",
                    disagg=DisaggConfig(mode="always", transfer_timeout_s=20.0), step_timeout_s=90,
                    kv_transport=kv_transport)
  try:
    outs = cluster.generate(prompts, sampling)
    assert [o.token_ids for o in outs] == want
    assert all(o.prefill_worker == 0 and o.worker == 1 and o.retries == 0 for o in outs)
    assert cluster.stats()["remote_prefills"] == len(prompts)
    # A transfer that never lands times out, frees its reservation and the
    # request is recomputed on the decode worker: same tokens.
    cluster.disagg = DisaggConfig(mode="always", transfer_timeout_s=0.5)
    cluster.stall_transfers(1)
    [out] = cluster.generate(prompts[1:2], sampling)
    assert out.token_ids == want[1] and out.retries == 1 and out.error is None
    assert _pages_in_use(cluster) == [0, 0]
    rows = measure_transfer(cluster, src=0, dst=1, num_pages=[1, 8], repeats=1)
    assert rows[1]["bytes"] == 8 * rows[0]["bytes"] > 0 and rows[1]["bytes_per_s"] > 0
    assert _pages_in_use(cluster) == [0, 0]
  finally:
    cluster.shutdown()


def test_sigkill_of_a_worker_loses_and_duplicates_no_request(params_ref):
  params, ref = params_ref
  prompts = _prompts([5, 11, 8, 14, 6, 9], seed=1)
  sampling = SamplingParams(max_tokens=10)
  want = [o.token_ids for o in Engine(CFG, params, CONFIG).generate(prompts, sampling)]
  cluster = Cluster(_specs(ref, ["mixed", "mixed"]), backend="ray", router="round_robin",
                    step_timeout_s=90)
  try:
    cids = [cluster.submit(p, sampling) for p in prompts]
    streamed = {c: [] for c in cids}
    finished = {c: 0 for c in cids}
    steps = 0
    while cluster.has_unfinished():
      for cid, new, done in cluster.step():
        streamed[cid] += new
        finished[cid] += done
      steps += 1
      if steps == 4:  # mid-run: every request has tokens, none is done
        assert all(0 < len(v) < 10 for v in streamed.values())
        os.kill(cluster.pids()[1], signal.SIGKILL)
      assert steps < 200, "the cluster did not finish"
    outs = [cluster.output(c) for c in cids]
    assert [o.token_ids for o in outs] == want  # none lost, each with its full tokens
    assert all(streamed[c] == o.token_ids for c, o in zip(cids, outs))  # none served twice
    assert all(n == 1 for n in finished.values())
    assert [o.reroutes for o in outs] == [0, 1] * 3 and {o.worker for o in outs} == {0}
    assert cluster.stats()["live_workers"] == [True, False]
    assert "ActorDiedError" in cluster.workers[1].error or "RayActorError" in cluster.workers[1].error
    assert _pages_in_use(cluster) == [0]
  finally:
    cluster.shutdown()


def test_sigkill_of_the_prefill_process_mid_transfer(params_ref):
  # Pages offered on a dead process's transfer server never arrive: those
  # transfers time out and their requests are prefilled on the decode worker.
  params, ref = params_ref
  prompts = _prompts([22, 27, 31, 25, 29, 24], seed=2)
  sampling = SamplingParams(max_tokens=8)
  want = [o.token_ids for o in Engine(CFG, params, CONFIG).generate(prompts, sampling)]
  cluster = Cluster(_specs(ref, ["prefill", "decode"]), backend="ray", step_timeout_s=90,
                    disagg=DisaggConfig(mode="always", transfer_timeout_s=3.0))
  try:
    cids = [cluster.submit(p, sampling) for p in prompts]
    steps, killed_at, deadline = 0, None, time.monotonic() + 120
    while cluster.has_unfinished():
      cluster.step()
      steps += 1
      states = {cluster.request(c).state for c in cids}
      # Killed once some prompts are prefilled (pages offered or landed) and others are not.
      if killed_at is None and states & {"transfer", "decode"} and "prefill" in states:
        os.kill(cluster.pids()[0], signal.SIGKILL)
        killed_at = steps
      # A time bound, not a step bound: steps with nothing to run are quick,
      # and the transfers wait out a 3 s timeout.
      assert time.monotonic() < deadline, f"the cluster did not finish ({steps} steps)"
    assert killed_at is not None, "never caught prefills in flight"
    outs = [cluster.output(c) for c in cids]
    assert [o.token_ids for o in outs] == want and {o.finish_reason for o in outs} == {"length"}
    assert sum(o.reroutes for o in outs) >= 1  # taken from the dead prefill worker
    assert cluster.stats()["live_workers"] == [False, True]
    assert _pages_in_use(cluster) == [0]
  finally:
    cluster.shutdown()


GROUP_CFG = dataclasses.replace(CFG, num_kv_heads=4)  # kv heads split over 4 tensor ranks


def _group_spec(params_ref_):
  """One worker, two Ray actors with 2 CPU devices each: one jax.distributed
  group, a tp engine on its global 4-device mesh."""
  env = {**TEST_ENV, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(  # TEST_ENV's flags kept
      ["--xla_force_host_platform_device_count=2", TEST_ENV.get("XLA_FLAGS", "")]).strip()}
  return WorkerSpec(model=GROUP_CFG, params=params_ref_, config=CONFIG, num_cpus=0.5, env=env,
                    num_processes=2, mesh_axes={"tensor": 4}, layout="tp", name="group")


def test_a_worker_spanning_two_processes_equals_one_engine(params_ref):
  # Every command sent to both processes (SPMD), tokens from process 0.
  params = models.init_params(GROUP_CFG, jax.random.key(1))
  prompts = _prompts([3, 17, 9, 30, 5], seed=3)
  sampling = SamplingParams(max_tokens=6)
  want = [o.token_ids for o in Engine(GROUP_CFG, params, CONFIG).generate(prompts, sampling)]
  cluster = Cluster([_group_spec(ray.put(host_tree(params)))], backend="ray",
                    step_timeout_s=120, start_timeout_s=300)
  try:
    [worker] = cluster.workers
    group = worker.engine.actor.actors
    infos = ray.get([a.info.remote() for a in group], timeout=60)
    assert [i["process_index"] for i in infos] == [0, 1]
    assert {i["process_count"] for i in infos} == {2} and len(infos[0]["devices"]) == 4
    assert len({i["pid"] for i in infos} | {os.getpid()}) == 3  # two processes of its own
    outs = cluster.generate(prompts, sampling)
    assert [o.token_ids for o in outs] == want
    assert _pages_in_use(cluster) == [0]
    # Both processes ran every step on identical host state.
    stats = ray.get([a.stats.remote() for a in group], timeout=60)
    assert stats[0]["steps"] == stats[1]["steps"] > 0
    assert stats[0]["prompt_tokens"] == stats[1]["prompt_tokens"] == sum(map(len, prompts))
  finally:
    cluster.shutdown()
  with pytest.raises(ValueError, match="serves role 'mixed' only"):
    WorkerSpec(num_processes=2, role="prefill")


def test_sigkill_of_one_process_takes_its_group_out(params_ref):
  # Process 1 of the group dies mid-run: process 0's step fails in a
  # collective (or would hang there until the step deadline), the group is
  # taken out, and its requests are recomputed on the single-process worker:
  # the same tokens, none lost.
  params = models.init_params(GROUP_CFG, jax.random.key(1))
  ref = ray.put(host_tree(params))
  prompts = _prompts([5, 11, 8, 14], seed=4)
  sampling = SamplingParams(max_tokens=10)
  want = [o.token_ids for o in Engine(GROUP_CFG, params, CONFIG).generate(prompts, sampling)]
  single = WorkerSpec(model=GROUP_CFG, params=ref, config=CONFIG, num_cpus=0.5, env=ENV)
  cluster = Cluster([_group_spec(ref), single], backend="ray", router="round_robin",
                    step_timeout_s=30, start_timeout_s=300)
  try:
    group = cluster.workers[0].engine.actor.actors
    cids = [cluster.submit(p, sampling) for p in prompts]
    steps = 0
    while cluster.has_unfinished():
      cluster.step()
      steps += 1
      if steps == 3:
        os.kill(ray.get(group[1].pid.remote(), timeout=30), signal.SIGKILL)
      assert steps < 200, "the cluster did not finish"
    outs = [cluster.output(c) for c in cids]
    assert [o.token_ids for o in outs] == want and {o.worker for o in outs} == {1}
    assert [o.reroutes for o in outs] == [1, 0, 1, 0]
    err = cluster.workers[0].error  # on CPU gloo reports the lost peer at once
    assert "Gloo" in err or "GetTimeoutError" in err, err
    assert cluster.stats()["live_workers"] == [False, True]
  finally:
    cluster.shutdown()


def test_ray_backend_errors_name_the_problem(params_ref):
  params, _ = params_ref
  with pytest.raises(ValueError, match="backend must be one of"):
    Cluster([], backend="grpc")
  with pytest.raises(TypeError, match=r"workers\[0\] must be a WorkerSpec"):
    Cluster([object()], backend="ray")
  with pytest.raises(ValueError, match="cannot take KV pages from prefill workers"):
    Cluster([WorkerSpec(role="prefill"), WorkerSpec(num_processes=2)], backend="ray")
  with pytest.raises(ValueError, match="kv_transport must be one of"):
    Cluster([WorkerSpec()], backend="ray", kv_transport="nccl")
  with pytest.raises(ValueError, match="role must be one of"):
    WorkerSpec(role="verify")
