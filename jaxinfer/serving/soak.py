"""A serving soak: random traffic and injected faults over a `Cluster`, with
the serving invariants checked after every step (`experiments/soak.py`).

Traffic: Poisson arrivals of prompts from a pool (a shared system prefix for
most: prefix-cache hits; some long ones: remote prefills and preemptions),
random max_tokens and stop tokens, and a bounded queue (a full one refuses:
`QueueFull`, counted, never dropped). Faults: aborts, a worker stopped and a
fresh one put in service in its place (`Cluster.add_worker`), KV transfers
that never land (they time out and are retried). Checked after every step:

- each request ends exactly once: its finish reason, once set, never
  changes, no finished event arrives twice, no tokens arrive after the end;
- no page leaks: every live worker's allocators are consistent (each page
  referenced, free or cached, exactly one) and each page's refcount equals
  the references the engine's requests, the flow's reservations and its
  in-flight transfers hold; once the cluster drains, no page is referenced;
- no request reads another's KV: every ended request's tokens are the
  reference greedy tokens of its prompt from a plain single `Engine` (a
  prefix of them when aborted), so a prefix hit on the wrong pages or a
  page freed while in use shows up as different tokens;
- host RSS is sampled every 25 steps: the report gives its start, its value
  halfway through, its peak and its end. Stopped workers free their device
  memory (`Engine.release`) and the step shapes are fixed, so once the
  programs are compiled RSS stays flat (`end - half`).

A violation raises `SoakViolation` naming the step and the request.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import numpy as np

from jaxinfer import config as config_module
from jaxinfer.engine.engine import Engine, EngineConfig
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.engine.speculative import MTPConfig
from jaxinfer.serving.cluster import Cluster
from jaxinfer.serving.disagg import DisaggConfig
from jaxinfer.serving.flow import QueueFull
from jaxinfer.serving.worker import Worker


class SoakViolation(AssertionError):
  """A serving invariant broke (the message names the step and request)."""


@dataclasses.dataclass(frozen=True)
class SoakConfig:
  seconds: float = 60.0  # wall-clock length of the traffic (then the cluster drains)
  steps: int | None = None  # or: this many cluster steps of traffic (a fixed amount of work)
  seed: int = 0
  arrivals_per_step: float = 0.8  # Poisson mean
  abort_prob: float = 0.05  # per step: abort one random live request
  stall_prob: float = 0.05  # per step: the next KV transfer never lands
  restart_every_steps: int = 60  # stop a worker, start a fresh one in its place
  max_queue: int = 10
  max_tokens: int = 24
  pool_size: int = 32  # distinct prompts (each one's reference tokens are computed once)
  long_prompt_prob: float = 0.15
  speculative: int = 0  # MTP draft tokens per worker step (0: plain decoding)
  # Fixed step shapes: a handful of compiles under any traffic (as serving runs).
  engine: EngineConfig = EngineConfig(page_size=16, num_pages=48, max_num_seqs=6,
                                      max_num_batched_tokens=96, fixed_step_shapes=True)


def prompt_pool(tokenizer, seed: int, n: int = 32) -> list[list[int]]:
  """Prompts of real text (this library's source): most behind one of two
  shared system prefixes, a quarter long (about 400 tokens)."""
  text = inspect.getsource(config_module)
  rng = np.random.default_rng(seed)
  systems = [text[:200], text[1000:1150]]
  pool = []
  for i in range(n):
    start = int(rng.integers(2000, len(text) - 600))
    body = text[start:start + (400 if i % 4 == 3 else int(rng.integers(10, 60)))]
    pool.append(tokenizer.encode((systems[i % 2] if i % 3 else "") + body))
  return pool


def _rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


class Soak:
  """One soak over a fresh cluster of cfg/params: see the module docstring."""

  def __init__(self, cfg, params, tokenizer, config: SoakConfig):
    self.cfg, self.params, self.config = cfg, params, config
    self.rng = np.random.default_rng(config.seed)
    self.pool = prompt_pool(tokenizer, config.seed, config.pool_size)
    greedy = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    ref_engine = Engine(cfg, params, config.engine)
    self.reference = [o.token_ids for o in ref_engine.generate(self.pool, greedy)]
    self.eos = set(cfg.eos_token_ids)
    self.cluster = Cluster([self._worker("prefill", 0), self._worker("decode", 1),
                            self._worker("mixed", 2)], max_queue=config.max_queue,
                           disagg=DisaggConfig(max_local_prefill_length=128,
                                               transfer_timeout_s=1.0, max_retries=2))
    self.ended: dict[int, tuple] = {}  # cid -> (reason, tokens) when first seen ended
    self.prompt_of: dict[int, int] = {}  # cid -> pool index
    self.counts = dict(submitted=0, refused=0, aborts=0, stops=0, restarts=0, stalls=0, steps=0)
    self.rss = [_rss_mb()]

  def _worker(self, role: str, index: int) -> Worker:
    c = self.config
    spec = MTPConfig(num_draft_tokens=c.speculative) if c.speculative else None
    return Worker(self.cfg, self.params, dataclasses.replace(c.engine, speculative=spec),
                  role=role, name=f"{role}{index}")

  # ------------------------------------------------------------ traffic and faults

  def _submit(self) -> None:
    c, rng = self.config, self.rng
    long = rng.random() < c.long_prompt_prob
    i = int(rng.choice([j for j in range(len(self.pool)) if (j % 4 == 3) == long]))
    stop = [int(rng.integers(0, self.cfg.vocab_size))] if rng.random() < 0.2 else []
    sampling = SamplingParams(max_tokens=int(rng.integers(1, c.max_tokens + 1)), temperature=0.0,
                              stop_token_ids=stop)
    self.counts["submitted"] += 1
    try:
      cid = self.cluster.submit(self.pool[i], sampling)
    except QueueFull:
      self.counts["refused"] += 1
      return
    self.prompt_of[cid] = i

  def _faults(self, step: int) -> list:
    c, rng, cl = self.config, self.rng, self.cluster
    live = [cid for cid in self.prompt_of if cl.output(cid).finish_reason is None]
    if live and rng.random() < c.abort_prob:
      cl.abort(int(rng.choice(live)))
      self.counts["aborts"] += 1
    if rng.random() < c.stall_prob:
      cl.stall_transfers(1)
      self.counts["stalls"] += 1
    events = []
    if step and step % c.restart_every_steps == 0:
      alive = [i for i, w in enumerate(cl.workers) if w.alive]
      i = int(rng.choice(alive))
      role = cl.workers[i].role
      events += cl.stop_worker(i, reason="soak: stopped")
      cl.add_worker(self._worker(role, len(cl.workers)))
      self.counts["stops"] += 1
      self.counts["restarts"] += 1
    return events

  # ------------------------------------------------------------ invariants

  def _fail(self, step: int, what: str):
    raise SoakViolation(f"step {step}: {what}")

  def _check_events(self, step: int, events) -> None:
    for cid, new, finished in events:
      if cid in self.ended and (new or finished):
        self._fail(step, f"request {cid} got {'tokens' if new else 'a finished event'} after "
                         f"it ended ({self.ended[cid][0]})")

  def _check_requests(self, step: int) -> None:
    for cid, i in self.prompt_of.items():
      out = self.cluster.output(cid)
      now = (out.finish_reason, list(out.token_ids))
      if cid in self.ended:
        if now != self.ended[cid]:
          self._fail(step, f"request {cid} changed after it ended: {self.ended[cid]} -> {now}")
      elif out.finish_reason is not None:
        self.ended[cid] = now
        self._check_tokens(step, cid, i, out)

  def _check_tokens(self, step: int, cid: int, i: int, out) -> None:
    got, sampling = list(out.token_ids), self.cluster.request(cid).sampling
    want = self.reference[i][:len(got)]
    if out.finish_reason == "error":
      ok = bool(out.error)
    elif out.finish_reason == "stop":
      ok = got == want and bool(got) and (got[-1] in self.eos or got[-1] in sampling.stop_token_ids)
    elif out.finish_reason == "length":
      ok = got == want and len(got) == sampling.max_tokens
    else:  # abort
      ok = got == want
    if not ok:
      self._fail(step, f"request {cid} ({out.finish_reason}, prompt {i}, max_tokens "
                       f"{sampling.max_tokens}) has tokens {got}; the reference greedy tokens are "
                       f"{self.reference[i]} (error: {out.error})")

  def _check_pages(self, step: int, drained: bool = False) -> None:
    cl = self.cluster
    for w_i, w in enumerate(cl.workers):
      if not w.alive:
        continue
      eng = w.engine
      want = [np.zeros(a.num_pages, np.int32) for a in eng.allocators]
      for req in eng.core.requests.values():
        if not req.finished or (req.hold_pages and req.pages):
          np.add.at(want[req.rank], req.pages, 1)
      for fr in cl._active.values():
        if fr.reservation is not None and fr.reservation[0] == w_i:
          np.add.at(want[fr.reservation[1]], fr.reservation[2], 1)
        if fr.transfer is not None and fr.worker == w_i:
          np.add.at(want[fr.transfer.rank], fr.transfer.pages, 1)
      for rank, a in enumerate(eng.allocators):
        try:
          a.check_consistency()
        except AssertionError as e:
          self._fail(step, f"worker {w.name} rank {rank}: allocator inconsistent ({e})")
        leaked = np.flatnonzero(a.refcount != want[rank])
        if leaked.size:
          self._fail(step, f"worker {w.name} rank {rank}: pages {leaked[:8].tolist()} have "
                           f"refcounts {a.refcount[leaked[:8]].tolist()}, the live holders "
                           f"{want[rank][leaked[:8]].tolist()}")
        if drained and a.num_used():
          self._fail(step, f"worker {w.name} rank {rank}: {a.num_used()} pages still referenced "
                           "after the cluster drained")

  # ------------------------------------------------------------ run

  def run(self) -> dict:
    c, cl = self.config, self.cluster
    t0 = time.perf_counter()
    step = drain_steps = 0
    traffic = lambda: (step < c.steps if c.steps is not None
                       else time.perf_counter() - t0 < c.seconds)
    while traffic() or cl.has_unfinished():
      if traffic():
        for _ in range(self.rng.poisson(c.arrivals_per_step)):
          self._submit()
        events = self._faults(step)
      else:
        events = []
        drain_steps += 1
        if drain_steps > 20_000:
          stuck = {r.cid: (r.state, r.worker, r.prefill_worker, r.retries)
                   for r in cl._active.values()}
          self._fail(step, f"the cluster did not drain: (state, worker, prefill worker, "
                           f"retries) of the requests left: {stuck}")
      events += cl.step()
      step += 1
      self._check_events(step, events)
      self._check_requests(step)
      self._check_pages(step)
      if step % 25 == 0:
        self.rss.append(_rss_mb())
    self._check_pages(step, drained=True)
    missing = [cid for cid in self.prompt_of if cid not in self.ended]
    if missing:
      self._fail(step, f"requests {missing[:8]} never ended")
    self.rss.append(_rss_mb())
    self.counts["steps"] = step
    return self.report(time.perf_counter() - t0)

  def report(self, seconds: float) -> dict:
    reasons = [r for r, _ in self.ended.values()]
    stats = self.cluster.stats()
    return dict(
        seconds=round(seconds, 1), speculative=self.config.speculative, **self.counts,
        accepted=len(self.prompt_of),
        ended={r: reasons.count(r) for r in sorted(set(reasons))},
        tokens=sum(len(t) for _, t in self.ended.values()),
        retries=stats["retries"], reroutes=stats["reroutes"],
        remote_prefills=stats["remote_prefills"], prefix_hit_rate=round(stats["prefix_hit_rate"], 3),
        preemptions=sum(s.num_preemptions for w in self.cluster.workers
                        for s in w.engine.schedulers),
        violations=0,
        rss_mb=dict(start=round(self.rss[0]), half=round(self.rss[len(self.rss) // 2]),
                    peak=round(max(self.rss)), end=round(self.rss[-1])))


def soak(cfg, params, tokenizer, config: SoakConfig = SoakConfig()) -> dict:
    """Runs one soak (see the module docstring) -> its report; raises
    `SoakViolation` on the first broken invariant."""
    return Soak(cfg, params, tokenizer, config).run()
