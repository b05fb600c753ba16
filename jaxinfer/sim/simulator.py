"""Discrete-event cluster simulator: the serving request flow and the
engine's own host core over simulated workers whose step times come from a
model (`sim/cost.py`: a roofline of a model on a device table, or a fit of
measured step times).

  spec = WorkerSpec(cost=RooflineCost(...), config=EngineConfig(...), ranks=2, gpus_per_rank=1)
  result = Simulator([spec, ...], router="kv", disagg=DisaggConfig(mode="always")).run(items)
  result.summary()       # tokens/s(/GPU), TTFT / TPOT percentiles, prefix hits, and why

What runs for real and what is modelled:
  real      the cluster's request flow (`serving.flow.Flow`, the code
            `Cluster` runs: the `Router` with its page-hash events and load
            reports after every step, `DisaggConfig`'s rule, page
            reservation, the prefill -> decode hand-over through
            `disagg.Transfer`, timeouts, faults); per worker the engine's
            host core (`engine.core.HostCore`: one `Scheduler` +
            `PageAllocator` per attention-DP rank with batching, chunked
            prefill, prefix caching, preemption, MTP draft rows and their
            pages; the DP rank choice; `submit_prefilled`; the padded step
            shapes); see `sim/engine.py`.
  modelled  step times and K/V transfer times (a cost model); sampled tokens
            (always id 0: requests end on max_tokens, never on a stop token);
            MTP acceptance, drawn per decode row from per-position acceptance
            rates.

Assumptions, each a place where this differs from a real cluster:
  - a step's tokens are known when it ends, and the next step is scheduled
    then (the engine with async_scheduling=False; async scheduling hides
    the host's share, which the cost model then should not count);
  - the ranks of one instance step together; the step takes what the cost
    model says for their shapes (the slowest rank sets it);
  - instances run concurrently on their own devices (the one-process CPU
    `Cluster` steps its workers in turn on shared cores: simulate one);
  - no worker faults or stalled transfers are injected, and no queue bound
    is set (the flow's recovery paths are `Cluster`'s, tested there);
  - a remote prefill's pages are released when its transfer starts and the
    decode side gets the K/V (whole pages) `kv_transfer_s` later.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.serving.cluster import percentiles
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.serving.flow import Flow
from jaxinfer.serving.router import Router
from jaxinfer.serving.worker import ROLES, EngineWorker
from jaxinfer.sim.cost import cost_per_million_tokens
from jaxinfer.sim.engine import SimEngine, WorkerSpec, _Stats


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
  """One simulation: the event heap over the flow and the simulated workers."""

  def __init__(self, sim: Simulator, items, concurrency):
    if not items:
      raise ValueError("items is empty")
    self.sim, self.items, self.concurrency = sim, items, concurrency
    self.heap, self.seq, self.now = [], 0, 0.0
    clock = lambda: self.now
    self.workers = [EngineWorker(SimEngine(s, clock=clock, wake_at=self._poll_at, name=str(i)),
                                 role=s.role, name=s.name or f"{s.role}{i}")
                    for i, s in enumerate(sim.specs)]
    for k, it in enumerate(items):
      if not len(it.prompt) or it.max_tokens < 1:
        raise ValueError(f"items[{k}]: needs a non-empty prompt and max_tokens >= 1")
      for i, w in enumerate(self.workers):
        try:
          w.engine.check_request(it.prompt, SamplingParams(max_tokens=it.max_tokens))
        except ValueError as e:
          raise ValueError(f"items[{k}]: worker {i} ({w.role}) would reject it: {e}") from None
    router = Router(len(self.workers), sim.page_size, sim.router_policy, **sim.router_options)
    self.flow = Flow(self.workers, router=router, disagg=sim.disagg, clock=clock)
    self.rng = np.random.default_rng(sim.seed)
    self.item_of: dict[int, int] = {}  # flow request id -> item index
    self.next_item = 0
    self.emitted: list[tuple[float, int]] = []  # (time, tokens) per step end
    self.last_issue_s = 0.0

  def _push(self, t: float, kind: str, arg) -> None:
    heapq.heappush(self.heap, (t, self.seq, kind, arg))
    self.seq += 1

  def _poll_at(self, t: float) -> None:
    self._push(t, "poll", None)

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
    while self.heap:
      self.now, _, kind, arg = heapq.heappop(self.heap)
      if kind == "arrival":
        it = self.items[arg]
        cid = self.flow.submit(it.prompt, SamplingParams(max_tokens=it.max_tokens),
                               arrival_s=self.now)
        self.item_of[cid] = arg
      elif kind == "step_end":
        self._step_end(arg)
      else:
        self.flow.poll_transfers()
      if not self.heap or self.heap[0][0] > self.now:
        # Everything that happened at this instant is queued (a burst's
        # requests join one step, as the real cluster submits all arrived
        # requests before stepping); start the idle workers with work.
        for i, w in enumerate(self.workers):
          if not w.engine.busy and w.has_work():
            dt = w.engine.dispatch(self.rng)
            if dt is not None:
              self._push(self.now + dt, "step_end", i)
    return self._result()

  def _step_end(self, i: int) -> None:
    engine_events = self.workers[i].engine.complete(self.rng)
    self.emitted.append((self.now, sum(len(new) for _, new, _ in engine_events)))
    for _, _, finished in self.flow.advance(i, engine_events):
      if finished and self.concurrency is not None and self.next_item < len(self.items):
        self._issue(self.now)

  def _result(self) -> "SimResult":
    out = []
    for cid in sorted(self.item_of, key=self.item_of.get):
      r = self.flow.request(cid)
      out.append(RequestResult(
          index=self.item_of[cid], arrival_s=r.arrival_s, first_token_s=r.first_token_s,
          finish_s=r.finish_s, prompt_tokens=len(r.prompt), tokens=len(r.tokens),
          cached_prompt_tokens=r.cached_prompt_tokens, worker=r.worker,
          prefill_worker=-1 if r.prefill_worker is None else r.prefill_worker))
    window = None
    if self.concurrency is not None:
      first_finish = min(r.finish_s for r in out)
      if self.last_issue_s > first_finish:
        window = (first_finish, self.last_issue_s)
    stats = [w.engine.stats for w in self.workers]
    return SimResult(requests=out, specs=self.sim.specs, stats=stats, emitted=self.emitted,
                     transfers=sum(r.prefill_worker >= 0 for r in out),
                     transfer_s=sum(st.transfer_s for st in stats), steady_window=window)


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
