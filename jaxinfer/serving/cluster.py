"""A serving cluster in one process: workers, a router, optional
disaggregated prefill, fault handling and a bounded queue. (With
backend="ray" each worker runs in a process of its own: `ray_cluster`.)

  cluster = Cluster([Worker(...), ...], router="kv")
  cid = cluster.submit(prompt, SamplingParams(...))       # or cluster.run(workload items)
  while cluster.has_unfinished(): cluster.step()
  cluster.output(cid)                                      # tokens, finish reason or error, TTFT, TPOT

Every request ends with its tokens or an explicit error; none is dropped or
served twice:
- a worker that is stopped (`stop_worker`) or raises in its step is taken
  out of service, and its requests are re-routed to the live workers and
  recomputed there from their prompt plus the tokens already emitted (the
  emitted tokens stand; the request continues after them);
- a KV transfer that does not land in time frees its reservation and the
  request is retried (its first token stands), up to `max_retries`;
- `submit` raises `QueueFull` when `max_queue` requests already wait for
  their first token, instead of queueing without limit.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.serving import ray_cluster, replay
from jaxinfer.serving.disagg import DisaggConfig, check_compatible
from jaxinfer.serving.flow import Flow, QueueFull, ServeOutput
from jaxinfer.serving.router import Router
from jaxinfer.serving.worker import Worker

BACKENDS = ("local", "ray")

__all__ = ["Cluster", "QueueFull", "ServeOutput", "percentiles"]


class Cluster(Flow):
  """Routes requests over workers and steps them; see the module docstring.

  backend="ray": the workers are `ray_cluster.WorkerSpec`s, each built in a
  Ray actor of its own (`ray_cluster.RayCluster`, same API and guarantees)."""

  def __new__(cls, workers=(), *args, backend: str = "local", **kwargs):
    if backend not in BACKENDS:
      raise ValueError(f"Cluster: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "ray":
      return ray_cluster.RayCluster(workers, *args, **kwargs)
    return super().__new__(cls)

  def __init__(self, workers: Sequence[Worker], *, router: Router | str = "kv",
               disagg: DisaggConfig | None = None, max_queue: int | None = None,
               router_options: dict | None = None, clock: Callable[[], float] = time.perf_counter,
               backend: str = "local"):
    """workers: mixed and decode workers take requests; prefill workers only
    prefill for decode workers (then `disagg`, default `DisaggConfig()`).
    router: a `Router`, or its policy name ("kv", "round_robin", "random",
    "least_loaded") with `router_options`. backend: "local" (this process)
    or "ray" (see the class docstring)."""
    super().__init__(workers, router=router, disagg=disagg, max_queue=max_queue,
                     router_options=router_options, clock=clock)
    for p in self._prefill:
      for d in self._serving:
        check_compatible(self.workers[p].engine, self.workers[d].engine)

  def add_worker(self, worker: Worker) -> int:
    """A new worker in service (`Flow.add_worker`), checked against the
    disaggregation pairs it joins (live workers: a stopped one has released
    its engine). -> its index."""
    pairs = ([(worker, self.workers[d]) for d in self._live(self._serving)]
             if worker.role == "prefill"
             else [(self.workers[p], worker) for p in self._live(self._prefill)])
    for prefill, decode in pairs:
      check_compatible(prefill.engine, decode.engine)
    return super().add_worker(worker)

  def step(self) -> list[tuple[int, list[int], bool]]:
    """Lands the transfers that have arrived, then steps every live worker
    with work once. -> (request id, new tokens, finished) events."""
    events = []
    self.poll_transfers()
    for i, w in enumerate(self.workers):
      if not w.alive:
        continue
      try:
        worker_events = w.step()
      except Exception as e:  # noqa: BLE001 - a failing worker is taken out, not fatal
        events += self.stop_worker(i, f"worker {w.name} raised {type(e).__name__}: {e}")
        continue
      events += self.advance(i, worker_events)
    return events

  def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> list[ServeOutput]:
    """Submits every prompt at once and serves them to the end (outputs in order)."""
    return replay.generate(self, prompts, sampling)

  def run(self, items, sampling: SamplingParams | Callable | None = None, *,
          on_step: Callable[["Cluster", float], None] | None = None) -> list[ServeOutput]:
    """Replays a workload (`workloads.Item`s, arrival_s from now) in real
    time; outputs in item order. A request the bounded queue rejects ends
    with finish_reason "error" naming why. sampling: SamplingParams, or a
    function item -> SamplingParams (default: greedy, item.max_tokens).
    on_step(cluster, elapsed_s): called after every cluster step (faults,
    probes)."""
    return replay.run(self, items, sampling, on_step=on_step)


def percentiles(values, qs=(50, 90, 99)) -> dict:
  """{"mean", "p50", ...} of the values that are not None (NaN when none)."""
  vals = np.asarray([v for v in values if v is not None], np.float64)
  if vals.size == 0:
    return dict(mean=float("nan"), **{f"p{q}": float("nan") for q in qs})
  return dict(mean=float(vals.mean()), **{f"p{q}": float(np.percentile(vals, q)) for q in qs})
