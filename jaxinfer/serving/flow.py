"""The request flow of a serving cluster, written once: routing, conditional
disaggregation (reserve on the decode worker, prefill on a prefill worker,
hand the pages over), KV transfer timeouts and retries, worker faults and
the bounded queue.

`Cluster` runs it over `Worker`s (engines on devices) in wall-clock time;
the cluster simulator (`jaxinfer/sim/`) runs it over workers whose engines
step on an event clock with modelled step times. Either way a worker is an
`EngineWorker`: a role, a name, a liveness and an engine with the host API
below (`Engine`'s, `engine.core.HostCore`'s plus the K/V page moves).

  engine.max_model_len, check_request(prompt, sampling), submit(tokens,
  sampling, hold_pages=), output(rid), abort(rid), reserve_pages(n),
  take_pages(rid), take_drafts(rid), release_pages(rank, pages),
  submit_prefilled(...), read_pages(rank, pages), place_pages(blob),
  write_pages(rank, pages, blob)

The owner steps the workers and hands each step's engine events to
`advance`; it calls `poll_transfers` whenever transfers may have landed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.serving.disagg import DisaggConfig, Transfer
from jaxinfer.serving.router import Router
from jaxinfer.serving.worker import EngineWorker


class QueueFull(RuntimeError):
  """The cluster's queue is at `max_queue`: the request was not accepted."""


@dataclasses.dataclass(frozen=True)
class ServeOutput:
  """A cluster request's result: tokens, finish reason (or error), TTFT and
  TPOT in seconds, and where it ran."""

  request_id: int
  prompt_token_ids: list[int]
  token_ids: list[int]
  finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
  error: str | None  # why a request failed (finish_reason "error")
  ttft_s: float | None
  tpot_s: float | None
  worker: int | None  # the worker that decoded it last
  prefill_worker: int | None  # the prefill worker, when prefilled remotely
  cached_prompt_tokens: int  # prompt tokens served from the prefilling worker's prefix cache
  retries: int  # transfer timeouts retried
  reroutes: int  # moves after a worker stopped


@dataclasses.dataclass
class FlowRequest:
  """A cluster request's state while it moves between workers."""
  cid: int
  prompt: list[int]
  sampling: SamplingParams
  arrival_s: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  state: str = "new"  # "prefill" | "transfer" | "decode" | "done"
  worker: int | None = None
  rid: int | None = None  # the engine's request id on `worker` (or the prefill worker)
  prefill_worker: int | None = None
  reservation: tuple | None = None  # (worker, rank, pages) held for a remote prefill
  transfer: Transfer | None = None
  first_token_s: float | None = None
  finish_s: float | None = None
  finish_reason: str | None = None
  error: str | None = None
  cached_prompt_tokens: int = 0
  retries: int = 0
  reroutes: int = 0

  @property
  def remaining(self) -> int:
    return self.sampling.max_tokens - len(self.tokens)


class Flow:
  """Requests over workers: see the module docstring."""

  def __init__(self, workers: Sequence[EngineWorker], *, router: Router | str = "kv",
               disagg: DisaggConfig | None = None, max_queue: int | None = None,
               router_options: dict | None = None, clock: Callable[[], float]):
    self.workers = list(workers)
    if not self.workers:
      raise ValueError(f"{type(self).__name__}: give at least one worker")
    page_sizes = {w.page_size for w in self.workers}
    if len(page_sizes) != 1:
      raise ValueError(f"{type(self).__name__}: every worker needs the same page_size, "
                       f"got {sorted(page_sizes)}")
    self.page_size = page_sizes.pop()
    self._serving = [i for i, w in enumerate(self.workers) if w.role != "prefill"]
    self._prefill = [i for i, w in enumerate(self.workers) if w.role == "prefill"]
    if not self._serving:
      raise ValueError(f"{type(self).__name__}: needs at least one mixed or decode worker")
    if max_queue is not None and max_queue < 1:
      raise ValueError(f"{type(self).__name__}: max_queue must be >= 1 or None, got {max_queue}")
    self.disagg = disagg or DisaggConfig()
    self.router = (router if isinstance(router, Router) else
                   Router(len(self.workers), self.page_size, router, **(router_options or {})))
    self.max_queue = max_queue
    self.clock = clock
    self._requests: dict[int, FlowRequest] = {}
    self._active: dict[int, FlowRequest] = {}
    self._by_engine: dict[tuple[int, int], int] = {}  # (worker, engine rid) -> cid
    self._next = 0
    self._stall = 0  # fault injection: transfers to stall
    self.num_rejected = 0
    self.num_remote_prefills = self.num_local_prefills = 0

  # ------------------------------------------------------------ requests

  def submit(self, prompt: Sequence[int], sampling: SamplingParams | None = None, *,
             arrival_s: float | None = None) -> int:
    """Routes a request; returns its id. Bad input raises ValueError/TypeError
    (nothing queued); a full queue raises QueueFull."""
    if not self._live(self._serving):
      raise RuntimeError(f"{type(self).__name__}: no live worker to serve requests")
    prompt, sampling = self.workers[self._live(self._serving)[0]].engine.check_request(
        prompt, sampling)
    if self.max_queue is not None and self.num_queued() >= self.max_queue:
      self.num_rejected += 1
      raise QueueFull(f"{type(self).__name__}: {self.num_queued()} requests wait for their "
                      f"first token (max_queue={self.max_queue}); request rejected, retry later")
    cid = self._next
    self._next += 1
    req = FlowRequest(cid, prompt, sampling, self.clock() if arrival_s is None else arrival_s)
    self._requests[cid] = self._active[cid] = req
    self._route(req)
    return cid

  def num_queued(self) -> int:
    """Requests accepted and still waiting for their first token."""
    return sum(r.first_token_s is None for r in self._active.values())

  def has_unfinished(self) -> bool:
    return bool(self._active)

  def request(self, cid: int) -> FlowRequest:
    return self._requests[cid]

  def _live(self, indices) -> list[int]:
    return [i for i in indices if self.workers[i].alive]

  def _route(self, req: FlowRequest) -> None:
    """Sends a request (fresh, or resumed after a fault: prompt + its tokens so
    far) to a worker, prefilling remotely when that pays."""
    serving = self._live(self._serving)
    if not serving:
      return self._fail(req, "no live worker left to serve it")
    tokens = req.prompt + req.tokens
    hashes = self.router.page_hashes(tokens)
    if req.remaining <= 0 or len(tokens) >= self.workers[serving[0]].engine.max_model_len:
      return self._finish(req, "length")  # its last token arrived with the fault
    w = self.router.pick(tokens, serving, hashes)
    sampling = dataclasses.replace(req.sampling, max_tokens=req.remaining)
    prefill = self._live(self._prefill)
    if prefill and not req.tokens and self.workers[w].role == "decode":
      uncached = len(tokens) - self.router.overlap(w, tokens, hashes) * self.page_size
      queue = sum(r.state == "prefill" for r in self._active.values())
      if self.disagg.remote(uncached, queue):
        reservation = self.workers[w].engine.reserve_pages(len(tokens))
        if reservation is not None:
          p = self.router.pick(tokens, prefill, hashes)
          req.rid = self.workers[p].engine.submit(
              tokens, dataclasses.replace(sampling, max_tokens=1), hold_pages=True)
          req.state, req.worker, req.prefill_worker = "prefill", w, p
          req.reservation = (w, *reservation)
          self._by_engine[(p, req.rid)] = req.cid
          self.num_remote_prefills += 1
          return None
    try:
      req.rid = self.workers[w].engine.submit(tokens, sampling)
    except ValueError as e:  # e.g. the resumed request no longer fits this worker's pool
      return self._fail(req, f"worker {self.workers[w].name} cannot take it: {e}")
    req.state, req.worker, req.prefill_worker = "decode", w, None
    self._by_engine[(w, req.rid)] = req.cid
    self.num_local_prefills += not req.tokens
    return None

  def abort(self, cid: int) -> ServeOutput:
    req = self._requests.get(cid)
    if req is None:
      raise ValueError(f"abort: unknown request id {cid}")
    if req.state == "decode" and self.workers[req.worker].alive:
      self.workers[req.worker].engine.abort(req.rid)
    elif req.state == "prefill" and self.workers[req.prefill_worker].alive:
      self.workers[req.prefill_worker].engine.abort(req.rid)
    if req.state != "done":
      self._release_reservation(req)
      self._finish(req, "abort")
    return self.output(cid)

  # ------------------------------------------------------------ events

  def advance(self, i: int, worker_events) -> list[tuple[int, list[int], bool]]:
    """Worker i's step events (engine request id, new tokens, finished) ->
    the cluster's (request id, new tokens, finished) events; then reports
    the worker's load and prefix-page events to the router."""
    events = []
    for rid, new, finished in worker_events:
      events += self._on_event(i, rid, new, finished)
    w = self.workers[i]
    self.router.report(i, events=w.take_events(), **w.load())
    return events

  def _on_event(self, i: int, rid: int, new: list[int], finished: bool) -> list:
    cid = self._by_engine.get((i, rid))
    req = self._requests.get(cid) if cid is not None else None
    if req is None or req.state == "done" or req.rid != rid:
      return []  # a stale engine request (its cluster request moved on)
    if new and req.first_token_s is None:
      req.first_token_s = self.clock()
    req.tokens += new
    if not finished:
      return [(req.cid, new, False)]
    del self._by_engine[(i, rid)]
    out = self.workers[i].engine.output(rid)
    if req.state == "prefill":
      req.cached_prompt_tokens = out.metrics.cached_prompt_tokens
      return [(req.cid, new, self._prefilled(req, i, out.finish_reason))]
    if req.prefill_worker is None:
      req.cached_prompt_tokens = out.metrics.cached_prompt_tokens
    self._finish(req, out.finish_reason)
    return [(req.cid, new, True)]

  def _prefilled(self, req: FlowRequest, i: int, reason: str) -> bool:
    """A remote prefill finished on worker i: starts its K/V transfer into
    the reservation (or ends the request) -> whether it ended."""
    engine = self.workers[i].engine
    rank, pages = engine.take_pages(req.rid)
    drafts = engine.take_drafts(req.rid)
    done = (reason in ("stop", "abort") or req.remaining <= 0
            or len(req.prompt) + len(req.tokens) >= engine.max_model_len)
    if not done:
      w, d_rank, d_pages = req.reservation
      req.transfer = Transfer.start(engine, rank, pages, self.workers[w].engine, d_rank, d_pages,
                                    now=self.clock(), timeout_s=self.disagg.transfer_timeout_s,
                                    drafts=drafts)
      req.transfer.stalled = self._stall > 0
      self._stall -= self._stall > 0
      req.reservation = None  # the transfer owns it now
      req.state = "transfer"
    engine.release_pages(rank, pages)
    if done:
      self._release_reservation(req)
      self._finish(req, reason)
    return done

  def poll_transfers(self) -> None:
    """Lands the K/V transfers that have arrived; retries the timed-out ones."""
    now = self.clock()
    for req in [r for r in self._active.values() if r.state == "transfer"]:
      t = req.transfer
      if t.ready():
        t.land()
        req.rid = t.decode.submit_prefilled(req.prompt, req.tokens[0], req.sampling, t.rank,
                                            t.pages, arrival_s=req.arrival_s,
                                            first_token_s=req.first_token_s, drafts=t.drafts)
        req.transfer, req.state = None, "decode"
        self._by_engine[(req.worker, req.rid)] = req.cid
      elif now >= t.deadline:
        t.cancel()
        req.transfer = None
        req.retries += 1
        if req.retries > self.disagg.max_retries:
          self._fail(req, f"KV transfer timed out {req.retries} times "
                          f"(transfer_timeout_s={self.disagg.transfer_timeout_s})")
        else:
          self._route(req)  # resumes after the first token, prefilled locally

  def stall_transfers(self, count: int) -> None:
    """Fault injection: the next `count` KV transfers never land (they time out)."""
    self._stall += count

  # ------------------------------------------------------------ faults

  def stop_worker(self, i: int, reason: str = "stopped") -> list:
    """Takes worker i out of service and moves its requests to live workers
    (recomputed there). -> events of requests that could only fail."""
    if not 0 <= i < len(self.workers):
      raise ValueError(f"stop_worker: no worker {i} (have {len(self.workers)})")
    self.workers[i].stop(reason)
    self.router.remove_worker(i)
    events = []
    for req in list(self._active.values()):
      if req.state == "prefill" and req.prefill_worker == i:
        self._release_reservation(req)  # on its (live) decode worker
      elif req.state == "prefill" and req.reservation[0] == i:
        self.workers[req.prefill_worker].engine.abort(req.rid)  # its decode side is gone
        req.reservation = None
      elif req.state in ("decode", "transfer") and req.worker == i:
        req.transfer = None  # the reservation died with the worker's pool
      else:
        continue
      self._by_engine.pop((req.prefill_worker if req.state == "prefill" else req.worker,
                           req.rid), None)
      req.reroutes += 1
      self._route(req)
      if req.state == "done":
        events.append((req.cid, [], True))
    return events

  def add_worker(self, worker: EngineWorker) -> int:
    """Puts a new worker in service (a restarted process, a scale-up); its
    index is new (a stopped worker's is never reused). -> the index."""
    if worker.page_size != self.page_size:
      raise ValueError(f"add_worker: page_size {worker.page_size}, the cluster's is "
                       f"{self.page_size}")
    i = self.router.add_worker()
    if i != len(self.workers):
      raise RuntimeError(f"add_worker: the router has {i} workers, the flow {len(self.workers)}")
    self.workers.append(worker)
    (self._prefill if worker.role == "prefill" else self._serving).append(i)
    return i

  def _release_reservation(self, req: FlowRequest) -> None:
    if req.reservation is not None:
      w, rank, pages = req.reservation
      if self.workers[w].alive:
        self.workers[w].engine.release_pages(rank, pages)
      req.reservation = None
    if req.transfer is not None:
      if self.workers[req.worker].alive:
        req.transfer.cancel()
      req.transfer = None

  def _fail(self, req: FlowRequest, why: str) -> None:
    req.error = why
    self._finish(req, "error")

  def _finish(self, req: FlowRequest, reason: str) -> None:
    req.state, req.finish_reason, req.finish_s = "done", reason, self.clock()
    self._active.pop(req.cid, None)

  # ------------------------------------------------------------ results

  def output(self, cid: int) -> ServeOutput:
    req = self._requests.get(cid)
    if req is None:
      raise ValueError(f"output: unknown request id {cid}")
    ttft = None if req.first_token_s is None else req.first_token_s - req.arrival_s
    tpot = None
    if req.finish_s is not None and len(req.tokens) > 1 and req.first_token_s is not None:
      tpot = (req.finish_s - req.first_token_s) / (len(req.tokens) - 1)
    return ServeOutput(request_id=cid, prompt_token_ids=list(req.prompt),
                       token_ids=list(req.tokens), finish_reason=req.finish_reason,
                       error=req.error, ttft_s=ttft, tpot_s=tpot, worker=req.worker,
                       prefill_worker=req.prefill_worker,
                       cached_prompt_tokens=req.cached_prompt_tokens, retries=req.retries,
                       reroutes=req.reroutes)

  def stats(self) -> dict:
    reqs = list(self._requests.values())
    served = range(len(self.workers))
    return dict(
        requests=len(reqs), rejected=self.num_rejected,
        errors=sum(r.finish_reason == "error" for r in reqs),
        remote_prefills=self.num_remote_prefills, local_prefills=self.num_local_prefills,
        retries=sum(r.retries for r in reqs), reroutes=sum(r.reroutes for r in reqs),
        requests_per_worker=[sum(r.worker == w for r in reqs) for w in served],
        tokens_per_worker=[sum(len(r.tokens) for r in reqs if r.worker == w) for w in served],
        prefix_hit_rate=(sum(r.cached_prompt_tokens for r in reqs)
                         / max(1, sum(len(r.prompt) for r in reqs))),
        live_workers=[w.alive for w in self.workers])
