"""Discrete-event cluster simulator: the engine's own scheduler and the
serving router over simulated workers whose step times come from a model
(`sim_cost`: a roofline of a model on a device table, or a fit of measured
step times).

  spec = WorkerSpec(cost=RooflineCost(...), config=EngineConfig(...), ranks=2, gpus_per_rank=1)
  result = Simulator([spec, ...], router="kv", disagg=DisaggConfig(mode="always")).run(items)
  result.summary()       # tokens/s(/GPU), TTFT / TPOT percentiles, prefix hits, and why

What runs for real and what is modelled:
  real      one `Scheduler` + `PageAllocator` per attention-DP rank, as in
            `Engine` (batching, chunked prefill, prefix caching, preemption,
            MTP draft rows and their pages); the `Router` (policies, page-hash
            events, load reports after every step); `DisaggConfig`'s rule; the
            cluster's routing, page reservation and hand-over sequence
            (mirrors `Cluster._route`, `_on_event` and `_poll_transfers`), the
            engine's DP rank choice (`Engine._pick_rank`) and `submit_prefilled`.
  modelled  step times and K/V transfer times (a cost model); sampled tokens
            (always id 0: requests end on max_tokens, never on a stop token);
            MTP acceptance, drawn per decode row from per-position acceptance
            rates (P(accepted length > j), as `Engine.stats()` reports them).

Assumptions, each a place where this differs from a real cluster:
  - a step's tokens are known when it ends, and the next step is scheduled
    then (the engine with async_scheduling=False; async scheduling hides
    the host's share, which the cost model then should not count);
  - the ranks of one instance step together; the step takes what the cost
    model says for their shapes (the slowest rank sets it);
  - instances run concurrently on their own devices (the one-process CPU
    `Cluster` steps its workers in turn on shared cores: simulate one);
  - no faults, transfer timeouts or bounded queue (the real cluster's
    recovery paths are not exercised);
  - a remote prefill's pages are released when its transfer starts and the
    decode side gets the K/V `kv_transfer_s` later, as `Cluster` does.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.engine.scheduler import Request, Scheduler, capacity_error
from jaxinfer.kv_cache import PageAllocator
from jaxinfer.serving.cluster import percentiles
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.serving.router import Router
from jaxinfer.serving.sim_cost import StepShape, cost_per_million_tokens, step_shape
from jaxinfer.serving.worker import ROLES, drain_events, load_report

RANK_POLICIES = ("tokens", "round_robin")

# TensorRT-LLM's DeepSeek-R1 acceptance lengths with 1, 2, 3 MTP drafts
# (1.92, 2.58, 2.82; serving_facts.md) as P(accepted length > j): 0.92,
# 2.58 - 1.92, 2.82 - 2.58.
TRTLLM_R1_ACCEPTANCE = (0.92, 0.66, 0.24)


def check_acceptance(acceptance, k: int = 0) -> tuple[float, ...]:
  """Per-position acceptance P(accepted length > j), j = 0.. (each in [0, 1],
  non-increasing: a draft is only accepted after the ones before it)."""
  acc = tuple(float(a) for a in acceptance)
  if any(not 0 <= a <= 1 for a in acc):
    raise ValueError(f"acceptance values must be in [0, 1], got {acc}")
  if any(b > a for a, b in zip(acc, acc[1:])):
    raise ValueError(f"acceptance must be non-increasing (P(accepted length > j)), got {acc}")
  if len(acc) < k:
    raise ValueError(f"acceptance gives {len(acc)} positions for {k} MTP draft tokens")
  return acc


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
  """One simulated instance: its engine limits, cost model and role.

  config: the EngineConfig of the engine being modelled (page_size,
    num_pages per rank (None: what the cost model's memory holds),
    max_num_seqs, max_num_batched_tokens, prefill_chunk_size, max_model_len,
    enable_prefix_caching, fixed_step_shapes, speculative).
  ranks: attention-DP ranks simulated, each its own Scheduler + PageAllocator.
  gpus_per_rank: GPUs one simulated rank stands for (per-GPU figures).
  acceptance: MTP per-position acceptance (with config.speculative).
  rank_policy: "tokens" (the engine's: least pending tokens + KV held) or
    "round_robin" (by request count: what attention-DP balance improves on).
  instance_ranks: the instance's attention-DP ranks (0: `ranks`, all
    simulated). The other instance_ranks - ranks are not simulated: each
    step, each of them takes the shape of a random recent step of a
    simulated rank (a bootstrap), so the instance's step waits for prefill
    chunks on any of its ranks, as a real attention-DP step does.
  """
  cost: object
  config: EngineConfig = EngineConfig()
  role: str = "mixed"
  ranks: int = 1
  gpus_per_rank: float = 1.0
  acceptance: tuple[float, ...] = ()
  rank_policy: str = "tokens"
  instance_ranks: int = 0
  name: str = ""

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"WorkerSpec: role must be one of {ROLES}, got {self.role!r}")
    if not isinstance(self.ranks, int) or self.ranks < 1:
      raise ValueError(f"WorkerSpec: ranks must be an int >= 1, got {self.ranks!r}")
    if not self.gpus_per_rank > 0:
      raise ValueError(f"WorkerSpec: gpus_per_rank must be > 0, got {self.gpus_per_rank}")
    if self.instance_ranks and self.instance_ranks < self.ranks:
      raise ValueError(f"WorkerSpec: instance_ranks ({self.instance_ranks}) must be >= ranks "
                       f"({self.ranks}), or 0")
    if self.rank_policy not in RANK_POLICIES:
      raise ValueError(f"WorkerSpec: rank_policy must be one of {RANK_POLICIES}, "
                       f"got {self.rank_policy!r}")
    if not isinstance(self.config, EngineConfig):
      raise TypeError(f"WorkerSpec: config must be an EngineConfig, got {type(self.config)}")
    spec = self.config.speculative
    object.__setattr__(self, "acceptance", check_acceptance(
        self.acceptance, spec.num_draft_tokens if spec is not None else 0))
    if not hasattr(self.cost, "step_time"):
      raise TypeError("WorkerSpec: cost must have step_time(shapes) (a sim_cost model)")

  @property
  def gpus(self) -> float:
    return self.ranks * self.gpus_per_rank


@dataclasses.dataclass
class _Stats:
  steps: int = 0
  busy_s: float = 0.0
  parts: dict = dataclasses.field(default_factory=dict)
  # kind ("decode" | "mixed" | "prefill") -> [steps, seconds, decode seqs, prefill
  # tokens, mean and max over ranks of each rank's own work (cost.rank_seconds)]
  kinds: dict = dataclasses.field(default_factory=dict)
  decode_rows: int = 0  # sequence-steps that decoded
  decode_tokens: int = 0  # tokens those emitted (MTP: > decode_rows)


class _Worker:
  """A simulated instance at run time: the engine's schedulers without devices."""

  def __init__(self, spec: WorkerSpec, index: int):
    c = spec.config
    self.spec, self.index, self.role, self.cost = spec, index, spec.role, spec.cost
    self.max_model_len = c.max_model_len or getattr(spec.cost, "max_model_len", None)
    if not self.max_model_len:
      raise ValueError(f"worker {index}: give EngineConfig.max_model_len (the cost model "
                       "has no model to take it from)")
    self.page_size = c.page_size
    num_pages = c.num_pages or spec.cost.kv_pages(c.page_size)
    chunk = min(c.prefill_chunk_size or c.max_num_batched_tokens, c.max_num_batched_tokens)
    self.max_pages_per_seq = -(-self.max_model_len // c.page_size)
    self.allocators = [PageAllocator(num_pages, c.page_size,
                                     prefix_caching=c.enable_prefix_caching)
                       for _ in range(spec.ranks)]
    self.schedulers = [Scheduler(a, max_num_seqs=c.max_num_seqs,
                                 max_num_batched_tokens=c.max_num_batched_tokens,
                                 prefill_chunk_size=chunk, max_model_len=self.max_model_len)
                       for a in self.allocators]
    self.mtp = c.speculative
    self.busy = False
    self.inflight = None  # (scheduled per rank, K)
    self.owner: dict[int, tuple] = {}  # engine request id -> (simulated request, Request)
    self._next_id = 0
    self._rr = -1
    self.shadows = max(0, spec.instance_ranks - spec.ranks)
    self._recent: collections.deque = collections.deque(maxlen=512)  # simulated rank shapes
    self.stats = _Stats()

  # -- requests (mirrors Engine.submit / reserve_pages / submit_prefilled) ----

  def check(self, prompt_len: int, max_tokens: int) -> str | None:
    """Why the engine would reject this request, or None (Engine._validate)."""
    return capacity_error(prompt_len, max_tokens, max_model_len=self.max_model_len,
                          page_size=self.page_size, usable_pages=self.allocators[0].usable_pages)

  def _pick_rank(self) -> int:
    if self.spec.rank_policy == "round_robin":
      self._rr = (self._rr + 1) % len(self.schedulers)
      return self._rr
    return min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].load())

  def _new(self, owner, tokens, max_tokens, **fields) -> Request:
    rid, self._next_id = self._next_id, self._next_id + 1
    fields.setdefault("rank", self._pick_rank())
    req = Request(id=rid, prompt=tokens, sampling=SamplingParams(max_tokens=max_tokens),
                  stop_ids=frozenset(), **fields)
    self.owner[rid] = (owner, req)
    self.schedulers[req.rank].add(req)
    return req

  def submit(self, owner, tokens, max_tokens, hold_pages=False) -> Request:
    return self._new(owner, tokens, max_tokens, hold_pages=hold_pages)

  def reserve(self, num_tokens: int):
    rank = self._pick_rank()
    pages = self.allocators[rank].allocate(-(-num_tokens // self.page_size))
    return None if pages is None else (rank, pages)

  def submit_prefilled(self, owner, tokens, max_tokens, rank, pages) -> Request:
    return self._new(owner, tokens, max_tokens, rank=rank, pages=list(pages),
                     num_computed=len(tokens), output=[0], admitted=True)

  def has_work(self) -> bool:
    return any(s.has_work() for s in self.schedulers)

  # -- steps ---------------------------------------------------------------------

  def start(self, rng) -> float | None:
    """Schedules and 'dispatches' one step -> its duration (None: nothing to do)."""
    K = 0
    if self.mtp is not None:
      for sch in self.schedulers:  # Engine._step_speculative's K for the batch
        sch.spec_k = self.mtp.draft_tokens_for(
            min(len(sch.running) + len(sch.waiting), self.spec.config.max_num_seqs))
      K = max(s.spec_k for s in self.schedulers)
    per_rank = [s.schedule() for s in self.schedulers]
    if not any(per_rank):
      return None
    for sch, sched in zip(self.schedulers, per_rank):
      sch.on_dispatch(sched)
    shapes = [step_shape(sched, config=self.spec.config, max_pages_per_seq=self.max_pages_per_seq,
                         spec_k=sch.spec_k) for sch, sched in zip(self.schedulers, per_rank)]
    everyone = shapes
    if self.shadows:
      self._recent.extend(shapes)
      pick = rng.integers(0, len(self._recent), self.shadows)
      everyone = shapes + [self._recent[i] for i in pick]
    cost = self.cost.step_time(everyone)
    self._record(shapes, everyone, cost)
    self.inflight = (per_rank, K)
    self.busy = True
    return cost.seconds

  def _record(self, shapes: list[StepShape], everyone: list[StepShape], cost) -> None:
    """shapes: the simulated ranks'; everyone: with the bootstrapped others.
    A step's kind is the instance's (mixed when any rank carries prefill:
    every rank waits for it); the per-rank counts are the simulated ranks'."""
    st = self.stats
    st.steps += 1
    st.busy_s += cost.seconds
    for k, v in cost.parts.items():
      st.parts[k] = st.parts.get(k, 0.0) + v
    pre = sum(s.prefill_tokens for s in shapes)
    dec = sum(s.decode_seqs for s in shapes)
    any_pre = pre or any(s.prefill_tokens for s in everyone)
    any_dec = dec or any(s.decode_seqs for s in everyone)
    kind = "prefill" if not any_dec else "mixed" if any_pre else "decode"
    work = cost.rank_seconds or [s.tokens for s in everyone]
    row = st.kinds.setdefault(kind, [0, 0.0, 0, 0, 0.0, 0.0])
    for i, v in enumerate((1, cost.seconds, dec, pre, sum(work) / len(work), max(work))):
      row[i] += v
    st.decode_rows += dec

  def finish(self, rng) -> list:
    """The step in flight ends -> (request, new tokens, finished) events."""
    per_rank, K = self.inflight
    self.inflight, self.busy = None, False
    out = []
    for sch, sched in zip(self.schedulers, per_rank):
      if not sched:
        continue
      if self.mtp is None:
        events = sch.apply(sched, [0] * len(sched))
      else:
        acc = self.spec.acceptance
        u = rng.random(len(sched))
        # One uniform per row: accepted = #{j < drafts: u < P(length > j)}
        # gives P(accepted > j) exactly, and the drafts stop at the first miss.
        emitted = [1 + sum(1 for j in range(s.num_draft) if x < acc[j]) if s.samples else 1
                   for s, x in zip(sched, u)]
        for s, n in zip(sched, emitted):  # decode rows, as step_shape counts them
          if s.samples and s.num_tokens - s.num_draft == 1 and s.start >= len(s.request.prompt):
            self.stats.decode_tokens += n
        events = sch.apply_speculative(sched, [[0] * (K + 1)] * len(sched), emitted, K)
      out += events
    if self.mtp is None:
      self.stats.decode_tokens = self.stats.decode_rows
    return out


@dataclasses.dataclass
class _Req:
  index: int
  prompt: list[int]
  max_tokens: int
  arrival_s: float
  state: str = "new"  # "prefill" | "transfer" | "decode" | "done"
  worker: int = -1
  prefill_worker: int = -1
  reservation: tuple | None = None
  tokens: int = 0
  first_token_s: float | None = None
  finish_s: float | None = None
  cached_prompt_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class RequestResult:
  index: int  # position in the workload
  arrival_s: float
  first_token_s: float
  finish_s: float
  prompt_tokens: int
  tokens: int
  cached_prompt_tokens: int  # prompt tokens the prefilling worker found cached
  worker: int
  prefill_worker: int  # -1: prefilled where it decoded

  @property
  def ttft_s(self) -> float:
    return self.first_token_s - self.arrival_s

  @property
  def tpot_s(self) -> float | None:
    if self.tokens < 2:
      return None
    return (self.finish_s - self.first_token_s) / (self.tokens - 1)


class Simulator:
  """Workers, a router and optional disaggregation; `run` replays a workload."""

  def __init__(self, workers: Sequence[WorkerSpec], *, router: str = "kv",
               router_options: dict | None = None, disagg: DisaggConfig | None = None,
               seed: int = 0):
    self.specs = list(workers)
    if not self.specs:
      raise ValueError("Simulator: give at least one WorkerSpec")
    for w in self.specs:
      if not isinstance(w, WorkerSpec):
        raise TypeError(f"Simulator: workers must be WorkerSpecs, got {type(w).__name__}")
    sizes = {w.config.page_size for w in self.specs}
    if len(sizes) != 1:
      raise ValueError(f"Simulator: every worker needs the same page_size, got {sorted(sizes)}")
    if not any(w.role != "prefill" for w in self.specs):
      raise ValueError("Simulator: needs at least one mixed or decode worker")
    self.page_size = sizes.pop()
    self.router_policy, self.router_options = router, dict(router_options or {})
    Router(len(self.specs), self.page_size, router, **self.router_options)  # validates
    self.disagg = disagg or DisaggConfig()
    self.seed = seed

  @property
  def gpus(self) -> float:
    return sum(w.gpus for w in self.specs)

  def run(self, items, *, concurrency: int | None = None) -> "SimResult":
    """Simulates `items` (workloads.Item): open loop at their arrival times,
    or closed loop with `concurrency` requests in flight (each finish issues
    the next item at once; arrival times ignored). Requests the engines
    would reject raise ValueError before anything runs."""
    if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
      raise ValueError(f"concurrency must be an int >= 1 or None, got {concurrency!r}")
    return _Run(self, list(items), concurrency).loop()


class _Run:
  """One simulation: the event heap and the cluster's request bookkeeping."""

  def __init__(self, sim: Simulator, items, concurrency):
    if not items:
      raise ValueError("items is empty")
    self.sim, self.items, self.concurrency = sim, items, concurrency
    self.workers = [_Worker(s, i) for i, s in enumerate(sim.specs)]
    self.serving = [i for i, w in enumerate(self.workers) if w.role != "prefill"]
    self.prefill = [i for i, w in enumerate(self.workers) if w.role == "prefill"]
    for k, it in enumerate(items):
      if not len(it.prompt) or it.max_tokens < 1:
        raise ValueError(f"items[{k}]: needs a non-empty prompt and max_tokens >= 1")
      for w in self.workers:
        why = w.check(len(it.prompt), it.max_tokens)
        if why:
          raise ValueError(f"items[{k}]: worker {w.index} ({w.role}) would reject it: {why}")
    self.router = Router(len(self.workers), sim.page_size, sim.router_policy,
                         **sim.router_options)
    self.rng = np.random.default_rng(sim.seed)
    self.heap, self.seq, self.now = [], 0, 0.0
    self.reqs: list[_Req] = []
    self.in_prefill = 0  # requests prefilling remotely (DisaggConfig's queue)
    self.next_item = 0
    self.emitted: list[tuple[float, int]] = []  # (time, tokens) per step end
    self.transfer_s = 0.0
    self.last_issue_s = 0.0

  def _push(self, t: float, kind: str, arg) -> None:
    heapq.heappush(self.heap, (t, self.seq, kind, arg))
    self.seq += 1

  def _issue(self, t: float) -> None:
    self._push(t, "arrival", self.next_item)
    self.next_item += 1
    self.last_issue_s = t

  def loop(self) -> "SimResult":
    if self.concurrency is None:
      for k, it in enumerate(self.items):
        self._push(float(it.arrival_s), "arrival", k)
      self.next_item = len(self.items)
    else:
      for _ in range(min(self.concurrency, len(self.items))):
        self._issue(0.0)
    wake: set[int] = set()
    while self.heap:
      self.now, _, kind, arg = heapq.heappop(self.heap)
      if kind == "arrival":
        wake.add(self._route(arg))
      elif kind == "step_end":
        wake |= self._step_end(arg)
      else:
        wake.add(self._transfer_end(arg))
      if not self.heap or self.heap[0][0] > self.now:
        # Everything that happened at this instant is queued (a burst's
        # requests join one step, as the real cluster submits all arrived
        # requests before stepping); start the idle workers with work.
        for w in sorted(wake):
          self._start(w)
        wake = set()
    return self._result()

  def _start(self, w: int) -> None:
    W = self.workers[w]
    if not W.busy and W.has_work():
      dt = W.start(self.rng)
      if dt is not None:
        self._push(self.now + dt, "step_end", w)

  # -- the cluster's request flow (mirrors serving.Cluster) ----------------------

  def _route(self, k: int) -> int:
    it = self.items[k]
    r = _Req(k, list(it.prompt), it.max_tokens, self.now)
    self.reqs.append(r)
    tokens = r.prompt
    hashes = self.router.page_hashes(tokens)
    w = self.router.pick(tokens, self.serving, hashes)
    W = self.workers[w]
    if self.prefill and W.role == "decode":
      uncached = len(tokens) - self.router.overlap(w, tokens, hashes) * self.sim.page_size
      if self.sim.disagg.remote(uncached, self.in_prefill):
        reservation = W.reserve(len(tokens))
        if reservation is not None:
          p = self.router.pick(tokens, self.prefill, hashes)
          self.workers[p].submit(r, tokens, 1, hold_pages=True)
          r.state, r.worker, r.prefill_worker, r.reservation = "prefill", w, p, reservation
          self.in_prefill += 1
          return p
    W.submit(r, tokens, r.max_tokens)
    r.state, r.worker = "decode", w
    return w

  def _step_end(self, w: int) -> set[int]:
    W = self.workers[w]
    wake = {w}
    n_tokens = 0
    for rid, new, finished in W.finish(self.rng):
      r, engine_req = W.owner[rid]
      n_tokens += len(new)
      if new and r.first_token_s is None:
        r.first_token_s = self.now
      r.tokens += len(new)
      if not finished:
        continue
      del W.owner[rid]
      if r.state == "prefill":
        self.in_prefill -= 1
        r.cached_prompt_tokens = engine_req.cached_prompt_tokens
        pages, engine_req.pages = engine_req.pages, []  # Engine.take_pages
        D = self.workers[r.worker]
        done = (r.tokens >= r.max_tokens
                or len(r.prompt) + r.tokens >= D.max_model_len)
        W.allocators[engine_req.rank].release(pages)  # the copy is in flight
        if done:
          rank, res_pages = r.reservation
          D.allocators[rank].release(res_pages)
          r.reservation = None
          self._finish(r)
        else:
          r.state = "transfer"
          dt = W.cost.kv_transfer_s(len(r.prompt))
          self.transfer_s += dt
          self._push(self.now + dt, "transfer", r)
      else:
        if r.prefill_worker < 0:
          r.cached_prompt_tokens = engine_req.cached_prompt_tokens
        self._finish(r)
        if self.concurrency is not None and self.next_item < len(self.items):
          self._issue(self.now)
    self.emitted.append((self.now, n_tokens))
    self.router.report(w, events=drain_events(W.allocators),
                       **load_report(W.schedulers, W.allocators))
    return wake

  def _transfer_end(self, r: _Req) -> int:
    D = self.workers[r.worker]
    rank, pages = r.reservation
    r.reservation = None
    D.submit_prefilled(r, r.prompt, r.max_tokens, rank, pages)
    r.state = "decode"
    return r.worker

  def _finish(self, r: _Req) -> None:
    r.state, r.finish_s = "done", self.now

  def _result(self) -> "SimResult":
    out = []
    for r in sorted(self.reqs, key=lambda r: r.index):
      out.append(RequestResult(index=r.index, arrival_s=r.arrival_s,
                               first_token_s=r.first_token_s, finish_s=r.finish_s,
                               prompt_tokens=len(r.prompt), tokens=r.tokens,
                               cached_prompt_tokens=r.cached_prompt_tokens, worker=r.worker,
                               prefill_worker=r.prefill_worker))
    window = None
    if self.concurrency is not None:
      first_finish = min(r.finish_s for r in self.reqs)
      if self.last_issue_s > first_finish:
        window = (first_finish, self.last_issue_s)
    return SimResult(requests=out, specs=self.sim.specs,
                     stats=[w.stats for w in self.workers], emitted=self.emitted,
                     transfers=sum(r.prefill_worker >= 0 for r in self.reqs),
                     transfer_s=self.transfer_s, steady_window=window)


@dataclasses.dataclass(frozen=True)
class SimResult:
  requests: list[RequestResult]  # in workload order
  specs: list[WorkerSpec]
  stats: list[_Stats]  # per worker
  emitted: list[tuple[float, int]]  # (time, tokens) per step end
  transfers: int  # remote prefills
  transfer_s: float  # their K/V transfer time, summed
  steady_window: tuple[float, float] | None  # closed loop: first finish -> last issue

  @property
  def gpus(self) -> float:
    return sum(s.gpus for s in self.specs)

  def summary(self, *, window="auto", price_per_gpu_hour: float | None = None) -> dict:
    """Throughput and latency. window: (t0, t1) counts the tokens emitted in
    it and the latencies of requests that arrived and finished inside it;
    "auto": the steady window of a closed-loop run, else the whole run from
    the first arrival to the last finish (the real cluster's wall time)."""
    done = [r for r in self.requests if r.finish_s is not None]
    if window == "auto":
      window = self.steady_window
    if window is not None:
      t0, t1 = window
      tokens = sum(n for t, n in self.emitted if t0 < t <= t1)
      sel = [r for r in done if r.arrival_s >= t0 and r.finish_s <= t1] or done
    else:
      t0 = min(r.arrival_s for r in self.requests)
      t1 = max(r.finish_s for r in done) if done else t0
      tokens, sel = sum(r.tokens for r in done), done
    dur = t1 - t0
    tps = tokens / dur if dur > 0 else math.nan
    ms = lambda v: None if v is None else v * 1e3
    out = dict(
        requests=len(self.requests), completed=len(done),
        output_tokens=sum(r.tokens for r in done), window_s=[t0, t1], duration_s=dur,
        latency_requests=len(sel), tokens_per_s=tps, gpus=self.gpus,
        tokens_per_s_per_gpu=tps / self.gpus,
        ttft_ms=percentiles([ms(r.ttft_s) for r in sel]),
        tpot_ms=percentiles([ms(r.tpot_s) for r in sel]),
        prefix_hit_rate=(sum(r.cached_prompt_tokens for r in done)
                         / max(1, sum(r.prompt_tokens for r in done))),
        remote_prefills=self.transfers,
        mean_transfer_ms=self.transfer_s / self.transfers * 1e3 if self.transfers else 0.0,
        why=self.why())
    if price_per_gpu_hour is not None:
      out["usd_per_million_tokens"] = cost_per_million_tokens(
          price_per_gpu_hour=price_per_gpu_hour, gpus=self.gpus, tokens_per_s=tps)
    return out

  def why(self) -> dict:
    """Per role: where the step time went and what the steps carried.
    step_ms by kind (decode only / mixed: decode with prefill chunks /
    prefill only), decode batch per rank, MTP tokens per decode row, the
    cost model's parts (ms per step), attention-DP balance (mean / max over
    the simulated ranks of each rank's own work, summed over steps; the
    measure TensorRT-LLM reports with tokens for work)."""
    out = {}
    for role in ROLES:
      idx = [i for i, s in enumerate(self.specs) if s.role == role]
      if not idx:
        continue
      st = [self.stats[i] for i in idx]
      steps = sum(s.steps for s in st)
      rank_steps = sum(s.steps * self.specs[i].ranks for s, i in zip(st, idx))
      kinds = {}
      for kind in ("decode", "mixed", "prefill"):
        rows = [s.kinds[kind] for s in st if kind in s.kinds]
        n = sum(r[0] for r in rows)
        if n:
          ranks = sum(r[0] * self.specs[i].ranks for s, i in zip(st, idx)
                      for r in [s.kinds.get(kind)] if r)
          kinds[kind] = dict(steps=n, share=n / steps,
                             step_ms=sum(r[1] for r in rows) / n * 1e3,
                             decode_seqs_per_rank=sum(r[2] for r in rows) / ranks,
                             prefill_tokens_per_rank=sum(r[3] for r in rows) / ranks,
                             attn_dp_balance=_ratio(rows))
      parts = {}
      for s in st:
        for k, v in s.parts.items():
          parts[k] = parts.get(k, 0.0) + v
      rows = sum(s.decode_rows for s in st)
      out[role] = dict(
          steps=steps, mean_step_ms=sum(s.busy_s for s in st) / max(steps, 1) * 1e3,
          kinds=kinds, parts_ms_per_step={k: v / max(steps, 1) * 1e3 for k, v in parts.items()},
          decode_seqs_per_rank=rows / max(rank_steps, 1),
          tokens_per_decode_row=sum(s.decode_tokens for s in st) / rows if rows else 0.0,
          attn_dp_balance=_ratio([r for s in st for r in s.kinds.values()]),
          busy_s=sum(s.busy_s for s in st))
    return out


def _ratio(rows) -> float:
  """mean / max rank work, summed over steps (1: balanced)."""
  return sum(r[4] for r in rows) / max(1e-12, sum(r[5] for r in rows))
