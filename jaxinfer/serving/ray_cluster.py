"""A serving cluster whose workers are Ray actors, one process each; the
router and the request flow (`flow.Flow`) stay in the driver.

  ray.init(num_cpus=2)
  cluster = Cluster([WorkerSpec(role="prefill"), WorkerSpec(role="decode")],
                    backend="ray", disagg=DisaggConfig(mode="always"))
  cluster.generate(prompts, SamplingParams(max_tokens=16))
  cluster.shutdown()

Each cluster step sends every live worker its `step` at once, then gathers
the answers (`ray.get` with a deadline), so the workers' devices run side by
side. Between steps the flow talks to each worker through a `RemoteEngine`
(remote_engine.py).

Faults: a worker whose actor dies (its process killed), whose step raises,
or that does not answer within `step_timeout_s` is taken out exactly as
`stop_worker` does (its requests re-routed and recomputed, none lost, none
served twice), and its actor is killed.

KV transfer (disaggregated prefill -> decode), `kv_transport`: "jax" (the
default) pulls the pages device to device with jax's transfer library, from
the prefill process's transfer server; "object_store" moves them as host
arrays through Ray's object store (see `ray_worker`). A transfer is ready
once the prefill process has offered (or stored) the pages; the decode
process fetches them when the flow lands the transfer. Transfer timeouts
and conditional disaggregation are the flow's, as in one process.
`measure_transfer` times the path.

A worker may span several processes (`WorkerSpec(num_processes=N)`, a
`jax.distributed` group on one global mesh): the driver sends its every
command to all N processes and reads process 0's answers (`ray_group`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import jaxinfer
from jaxinfer.serving import ray_group, replay
from jaxinfer.serving.disagg import DisaggConfig, check_compatible
from jaxinfer.serving.flow import Flow, ServeOutput
from jaxinfer.serving.ray_worker import WorkerSpec
from jaxinfer.serving.remote_engine import RemoteWorker, ray_module
from jaxinfer.serving.router import Router

# The directory holding the jaxinfer package: worker processes import the
# same jaxinfer as the driver (a source checkout or an installed package).
KV_TRANSPORTS = ("jax", "object_store")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxinfer.__file__)))


def _why(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[-1] if lines else ''}"


class RayCluster(Flow):
  """`Cluster(workers, backend="ray")`: see the module docstring."""

  def __init__(self, workers: Sequence[WorkerSpec], *, router: Router | str = "kv",
               disagg: DisaggConfig | None = None, max_queue: int | None = None,
               router_options: dict | None = None, clock: Callable[[], float] = time.perf_counter,
               step_timeout_s: float = 300.0, start_timeout_s: float = 600.0,
               kv_transport: str = "jax"):
    """workers: a `WorkerSpec` per worker (built in its actor). Ray is
    started on this host if it is not yet. step_timeout_s: a worker that
    does not answer a step (or `reserve_pages`) by then is taken out.
    kv_transport: how prefilled pages move, "jax" (jax's transfer library)
    or "object_store" (Ray's); see `ray_worker`."""
    ray = ray_module()
    specs = list(workers)
    for k, s in enumerate(specs):
      if not isinstance(s, WorkerSpec):
        raise TypeError(f"Cluster(backend='ray'): workers[{k}] must be a WorkerSpec (built in "
                        f"its own process), got {type(s).__name__}")
    if not step_timeout_s > 0:
      raise ValueError(f"Cluster(backend='ray'): step_timeout_s must be > 0, got {step_timeout_s}")
    if any(s.role == "prefill" for s in specs) and any(s.num_processes > 1 for s in specs):
      raise ValueError("Cluster(backend='ray'): a worker of num_processes > 1 cannot take KV "
                       "pages from prefill workers (not built); serve it without prefill workers")
    if kv_transport not in KV_TRANSPORTS:
      raise ValueError(f"Cluster(backend='ray'): kv_transport must be one of {KV_TRANSPORTS}, "
                       f"got {kv_transport!r}")
    if not ray.is_initialized():
      ray.init()
    actors = []
    try:
      for s in specs:  # a process each (this jaxinfer on its path), or a group of them
        actors.append(ray_group.start_actor(s, PACKAGE_ROOT, start_timeout_s))
      infos = ray.get([a.info.remote() for a in actors], timeout=start_timeout_s)
      if kv_transport == "jax":  # process groups hand over no KV (role "mixed")
        addresses = ray.get([a.transfer_address.remote() for a, s in zip(actors, specs)
                             if s.num_processes == 1], timeout=60)[::-1]
        infos = [dict(i, transfer_address=addresses.pop() if s.num_processes == 1 else None)
                 for i, s in zip(infos, specs, strict=True)]
    except Exception as e:
      self._kill(actors)
      raise RuntimeError(
          f"Cluster(backend='ray'): a worker failed to start within {start_timeout_s} s: "
          f"{_why(e)} (the workers ask for "
          f"{sum(s.num_cpus * s.num_processes for s in specs)} CPUs and "
          f"{sum(s.num_gpus * s.num_processes for s in specs)} GPUs; Ray has {ray.available_resources()} free)"
      ) from e
    self._attach(specs, actors, infos, step_timeout_s, dict(
        router=router, disagg=disagg, max_queue=max_queue, router_options=router_options,
        clock=clock))

  def _attach(self, specs, actors, infos, step_timeout_s: float, flow_options: dict) -> None:
    remote = [RemoteWorker(a, info, s, step_timeout_s)
              for a, info, s in zip(actors, infos, specs, strict=True)]
    try:
      super().__init__(remote, **flow_options)
      for p in self._prefill:
        for d in self._serving:
          check_compatible(self.workers[p].engine, self.workers[d].engine)
    except Exception:
      self._kill(actors)
      raise
    self.specs, self.step_timeout_s = specs, step_timeout_s

  def fresh(self, **flow_options) -> "RayCluster":
    """A new cluster on the same worker processes, with fresh engines (empty
    KV and prefix caches; each process keeps its compiled programs) and a
    fresh flow (`flow_options`: router, disagg, max_queue, ...): repeated
    benchmark runs without restarting processes or recompiling. This
    cluster is retired (its workers marked stopped; the actors are the new
    cluster's)."""
    if not all(w.alive for w in self.workers):
      raise RuntimeError("fresh: a worker of this cluster is stopped; start a new cluster")
    actors = [w.engine.actor for w in self.workers]
    infos = ray_module().get([a.reset.remote() for a in actors], timeout=self.step_timeout_s)
    infos = [dict(i, transfer_address=w.engine.info.get("transfer_address"))
             for i, w in zip(infos, self.workers, strict=True)]
    for w in self.workers:
      w.stop("retired: its processes serve a fresh cluster")
    new = object.__new__(RayCluster)
    new._attach(self.specs, actors, infos, self.step_timeout_s,
                dict(dict(clock=self.clock), **flow_options))
    return new

  @staticmethod
  def _kill(actors) -> None:
    for a in actors:
      ray_group.kill(a)

  def step(self) -> list[tuple[int, list[int], bool]]:
    """Lands the transfers that have arrived, then steps every live worker
    once, all at the same time. -> (request id, new tokens, finished) events."""
    ray = ray_module()
    events = []
    self.poll_transfers()
    for i, w in enumerate(self.workers):
      if w.alive and w.engine.dead:
        events += self.stop_worker(i, f"worker {w.name} (pid {w.pid}): {w.engine.dead}")
    pending = {i: w.engine.actor.step.remote() for i, w in enumerate(self.workers) if w.alive}
    deadline = time.monotonic() + self.step_timeout_s
    for i, ref in pending.items():
      w = self.workers[i]
      try:
        result = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
      except Exception as e:  # noqa: BLE001 - dead, hung or raising: taken out, not fatal
        events += self.stop_worker(i, f"worker {w.name} (pid {w.pid}) failed: {_why(e)}")
        continue
      events += self.advance(i, w.absorb(result))
      w.engine.release_untaken()
    return events

  def stop_worker(self, i: int, reason: str = "stopped") -> list:
    """`Flow.stop_worker`, then kills the worker's actor."""
    events = super().stop_worker(i, reason)
    self.workers[i].engine.dead = self.workers[i].engine.dead or reason
    self._kill([self.workers[i].engine.actor])
    return events

  def shutdown(self) -> None:
    """Kills every worker actor (the cluster serves nothing after)."""
    for i, w in enumerate(self.workers):
      if w.alive:
        self.stop_worker(i, "cluster shut down")

  def pids(self) -> list[int]:
    """The workers' process ids."""
    return [w.pid for w in self.workers]

  def generate(self, prompts, sampling=None) -> list[ServeOutput]:
    """Submits every prompt at once and serves them to the end (outputs in order)."""
    return replay.generate(self, prompts, sampling)

  def run(self, items, sampling=None, *, on_step=None) -> list[ServeOutput]:
    """Replays a workload in real time (`replay.run`); outputs in item order."""
    return replay.run(self, items, sampling, on_step=on_step)


def measure_transfer(cluster: RayCluster, *, src: int, dst: int, num_pages: Sequence[int],
                     repeats: int = 3) -> list[dict]:
  """Times the KV hand-over between two worker processes, by the cluster's
  kv_transport: pages read on worker src, written into pages reserved on
  worker dst, end to end (device to device). -> per size {pages, bytes,
  seconds (best of repeats), bytes_per_s, call_overhead_s (an empty round
  trip to dst, part of seconds)}."""
  ray = ray_module()
  a, b = cluster.workers[src].engine, cluster.workers[dst].engine
  overhead = min(_timed(lambda: ray.get(b.actor.pid.remote(), timeout=60)) for _ in range(repeats))
  rows = []
  for n in num_pages:
    reserved = ray.get(b.actor.reserve_pages.remote(n * cluster.page_size), timeout=60)
    if reserved is None:
      raise ValueError(f"measure_transfer: worker {dst} cannot reserve {n} pages")
    rank, pages = reserved
    best, size = float("inf"), 0
    for _ in range(repeats):
      t0 = time.perf_counter()
      blob = a.read_pages(0, list(range(n)))
      b.write_pages(rank, pages, blob)
      ray.get(b.actor.pid.remote(), timeout=120)  # answers after the write
      best = min(best, time.perf_counter() - t0)
      size = ray.get(blob.size_ref, timeout=60)
    b.release_pages(rank, pages)
    rows.append(dict(pages=n, bytes=size, seconds=best, bytes_per_s=size / best,
                     call_overhead_s=overhead))
  return rows


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0
