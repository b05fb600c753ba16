"""The speculative step runner: MTP draft-and-verify steps
(`speculative.spec_step`, run whole per rank under attention DP) on every
rank, with the draft-state slot of each running request and the acceptance
counters.

With async scheduling a decode-only batch is pipelined: the next step is
dispatched before the one in flight is read, its last tokens and positions
left to the device (`Scheduler.plan_continue`, `continue_with`). Anything else
(admissions, prefill chunks, preemption, a new draft budget K) reads the
step in flight first and schedules as usual, with K as the draft budget.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from jaxinfer.engine import logprobs, map_guard, scheduler, speculative, steps
from jaxinfer.engine.core import HostCore
from jaxinfer.engine.scheduler import Scheduled
from jaxinfer.engine.steps import (Events, StepCounts, StepModel, sampler_mode, sampling_fields,
                                   step_shapes)


@dataclasses.dataclass(frozen=True)
class SpecInFlight:
  """A dispatched speculative step: each rank's chunks, emitted on device
  (`spec_step`'s output, [n, B, K + 3]), its
  draft budget K and the emitted tokens' logprobs if computed."""
  per_rank: list[list[Scheduled]]
  emitted: jax.Array
  K: int
  logprobs: dict | None = None


class DraftSlots:
  """Rows of the device draft state, one per running request."""

  def __init__(self, num_slots: int):
    self.of: dict[int, int] = {}  # request id -> slot
    self._free = list(range(num_slots))

  def assign(self, running, scheduled: list[Scheduled]) -> None:
    """Frees the slots of requests no longer running (finished or
    preempted), then gives each newly scheduled request one."""
    live = {r.id for r in running}
    for rid in [rid for rid in self.of if rid not in live]:
      self._free.append(self.of.pop(rid))
    for s in scheduled:
      if s.request.id not in self.of:
        self.of[s.request.id] = self._free.pop()


class Acceptance:
  """Per draft position: drafts verified and accepted; per sequence-step
  that verified drafts: the tokens it emitted (accepted + 1)."""

  def __init__(self, max_draft: int):
    self.drafted = np.zeros(max_draft, np.int64)
    self.accepted = np.zeros(max_draft, np.int64)
    self.verifies = self.verify_tokens = 0

  def record(self, num_verified: int, num_emitted: int) -> None:
    self.drafted[:num_verified] += 1
    self.accepted[:num_emitted - 1] += 1
    self.verifies += 1
    self.verify_tokens += num_emitted

  def stats(self, num_draft_tokens: int) -> dict:
    with np.errstate(invalid="ignore", divide="ignore"):
      per_pos = np.where(self.drafted > 0, self.accepted / np.maximum(self.drafted, 1), np.nan)
    return dict(
        spec_num_draft_tokens=num_draft_tokens,
        spec_verify_steps=self.verifies,  # sequence-steps that verified drafts
        spec_mean_accepted_length=(self.verify_tokens / self.verifies if self.verifies
                                   else float("nan")),
        spec_acceptance_per_position=[float(a) for a in per_pos],
        spec_drafted_per_position=[int(d) for d in self.drafted])


def spec_batch(scheduled: list[Scheduled], shapes: steps.StepShapes, slot_of: dict, *,
               page_size: int, max_model_len: int):
  """Chunks -> (padded `SpecBatch`, real tokens). A decode block is [last
  token, K draft rows]: the drafts' values stay on device (`draft_j`), and a
  pipelined block (`from_state`) takes its last token from there too."""
  tokens, draft_j, positions, token_seq, chunk_next = [], [], [], [], []
  for i, s in enumerate(scheduled):
    known = s.request.tokens
    n_known = s.num_tokens - s.num_draft
    if s.from_state:  # the last token and the positions come from the device
      tokens += [0] * s.num_tokens
    else:
      tokens += known[s.start:s.start + n_known] + [0] * s.num_draft
    draft_j += [-1] * n_known + list(range(s.num_draft))
    positions += range(s.start, s.start + s.num_tokens)
    token_seq += [i] * s.num_tokens
    chunk_next.append(0 if s.samples else known[s.start + s.num_tokens])
  reqs = [s.request for s in scheduled]
  T, B, n, pad = shapes.tokens, shapes.seqs, len(tokens), steps.pad
  cu, table, last = steps.ragged_layout(shapes, [s.num_tokens for s in scheduled],
                                        [r.pages for r in reqs])
  samp = sampling_fields(reqs)
  batch = speculative.SpecBatch(
      tokens=pad(tokens, T, np.int32), draft_j=pad(draft_j, T, np.int32, -1),
      positions=pad(positions, T, np.int32), token_seq=pad(token_seq, T, np.int32),
      valid=pad(np.ones(n, bool), T, bool), cu_q_lens=cu,
      kv_lens=pad([s.start + s.num_tokens for s in scheduled], B, np.int32),
      page_table=table, logits_idx=last, slot=pad([slot_of[r.id] for r in reqs], B, np.int32),
      num_draft=pad([s.num_draft for s in scheduled], B, np.int32),
      samples=pad([s.samples for s in scheduled], B, bool),
      from_state=pad([s.from_state for s in scheduled], B, bool),
      chunk_next=pad(chunk_next, B, np.int32),
      capacity=pad([len(r.pages) * page_size for r in reqs], B, np.int32),
      max_len=pad([min(len(r.prompt) + r.sampling.max_tokens, max_model_len) for r in reqs],
                  B, np.int32),
      prompt_len=pad([len(r.prompt) for r in reqs], B, np.int32),
      temperature=pad(samp["temperature"], B, np.float32),
      top_k=pad(samp["top_k"], B, np.int32), top_p=pad(samp["top_p"], B, np.float32, 1.0),
      seeds=pad(samp["seeds"], B, np.uint32))
  return batch, n


class SpecRunner:
  """Speculative MTP steps on every rank together (an idle rank on an
  all-padding batch). The draft state [ranks * slots, K] lives on device
  between steps; under attention DP each rank owns its rows of it (sharded
  like the pool's pages) and its own slot map, and the step runs whole per
  rank (`speculative.spec_step` with `ranks`). Like `PlainRunner`, it holds
  the host core, takes the Engine's `StepModel`, pool and load on each call
  and returns the new pool and load."""

  def __init__(self, core: HostCore, model: StepModel):
    self.core, self.config = core, core.spec
    self.counts = StepCounts()
    self.guard = map_guard.ProgramGuard(core.config.max_map_fraction)
    self.in_flight: collections.deque[SpecInFlight] = collections.deque()
    K, S = self.config.num_draft_tokens, core.config.max_num_seqs
    self._state = speculative.init_state(model.cfg, core.num_ranks * S, K)
    self._slots = [DraftSlots(S) for _ in range(core.num_ranks)]
    self._acceptance = Acceptance(K)
    self._events: Events = []  # read by `dispatch`, for `read`
    self._keep = 0  # steps `read` leaves in flight
    if model.ranks is not None:  # each rank's block of rows on its devices
      self._state = jax.device_put(self._state,
                                   NamedSharding(model.ranks.mesh, P(model.ranks.axes)))

  def dispatch(self, model: StepModel, pool, load):
    """Continues the step in flight (pipelined) or reads it and schedules
    anew, then dispatches the step (when any rank has a chunk) -> (new pool,
    new load). The events of what it read wait for `read`."""
    core = self.core
    K = min(core.spec_draft_tokens(sch) for sch in core.schedulers)
    per_rank, self._events = None, []
    if self.in_flight and core.config.async_scheduling and self.in_flight[-1].K == K:
      per_rank = _continue(core.schedulers, self.in_flight[-1].per_rank, K)
    if per_rank is None:
      self._events = self._read(keep=0)
      per_rank = scheduler.schedule_ranks(core.schedulers, [K] * core.num_ranks, core.config)
      for slots, sch, scheduled in zip(self._slots, core.schedulers, per_rank):
        slots.assign(sch.running, scheduled)
      self._place_arrived_drafts(per_rank, core.config.max_num_seqs)
    busy = any(per_rank)
    self._keep = 1 if busy and core.config.async_scheduling else 0
    if busy:
      return self._dispatch(model, pool, load, per_rank, K)
    return pool, load

  def read(self) -> Events:
    """The events of the steps `dispatch` read, then of those in flight but,
    with async scheduling, the one it just dispatched."""
    events, self._events = self._events, []
    return events + self._read(self._keep)

  def _place_arrived_drafts(self, per_rank, slots_per_rank: int) -> None:
    """Writes the drafts that came with hand-over requests into their new slots."""
    for rank, (slots, scheduled) in enumerate(zip(self._slots, per_rank)):
      for s in scheduled:
        if s.request.drafts is not None:
          row = rank * slots_per_rank + slots.of[s.request.id]
          self._state = speculative.put_drafts(self._state, row, s.request.drafts)
          s.request.drafts = None

  def _dispatch(self, model: StepModel, pool, load, per_rank: list[list[Scheduled]], K: int):
    """-> (new pool, new load)."""
    t0 = time.perf_counter()
    core = self.core
    busy = [scheduled for scheduled in per_rank if scheduled]
    shapes = step_shapes(core, busy, core.chunk + K)
    built = [spec_batch(scheduled, shapes, slots.of, page_size=core.config.page_size,
                        max_model_len=core.max_model_len)
             for scheduled, slots in zip(per_rank, self._slots)]
    greedy, k_cap = sampler_mode(busy)
    want = logprobs.wanted([s for scheduled in busy for s in scheduled])
    kw = dict(max_q=shapes.max_q, K=K, ep=model.ep, greedy=greedy, k_cap=k_cap, logprobs=want[0])
    targets = logprobs.step_targets(per_rank, shapes.tokens) if want[1] else None
    packed = tuple(np.stack(fields) for fields in zip(*(b.pack() for b, _ in built)))
    program = (shapes, K, greedy, want, k_cap)
    self.guard.before(program)
    emitted, pool, self._state, load, lp = speculative.spec_step(
        model.cfg, model.params, pool, packed, self._state, load, targets, **kw,
        ranks=model.ranks, **model.heads)
    for sch, scheduled in zip(core.schedulers, per_rank):
      sch.on_dispatch(scheduled)
    self.counts.record(program, sum(n for _, n in built),
                       bool(self.in_flight), time.perf_counter() - t0)
    self.in_flight.append(SpecInFlight(per_rank, emitted, K, lp))
    return pool, load

  def _read(self, keep: int) -> Events:
    """Reads the steps in flight, oldest first, leaving `keep`."""
    events, ranks = [], self.core.num_ranks
    while len(self.in_flight) > keep:
      done = self.in_flight.popleft()
      K = done.K
      emitted, lp = jax.device_get((done.emitted, done.logprobs))  # the one read
      emitted = np.asarray(emitted).reshape(ranks, -1, K + 3)
      for sch, scheduled, rank_emitted, rank_lp in zip(self.core.schedulers, done.per_rank,
                                                       emitted, logprobs.split_ranks(lp, ranks)):
        out, n_emit, n_verified = (rank_emitted[:, :K + 1], rank_emitted[:, K + 1],
                                   rank_emitted[:, K + 2])
        for s, n, d in zip(scheduled, n_emit, n_verified):
          self.counts.tokens -= s.num_draft - int(d)  # drafts cut on device at max_len
          if s.samples and s.num_draft and not s.request.finished:
            self._acceptance.record(int(d), int(n))
        events += logprobs.applied(rank_lp, sch.apply_speculative, scheduled, out, n_emit, K)
        self._keep_handover_drafts(scheduled)
    return events

  def _keep_handover_drafts(self, scheduled: list[Scheduled]) -> None:
    """Held requests that finished (a disaggregated prefill): snapshot their
    draft-state row now, before the slot can go to another request."""
    for s in scheduled:
      req = s.request
      if req.hold_pages and req.finish_reason not in (None, "abort") and req.num_drafts:
        row = req.rank * self.core.config.max_num_seqs + self._slots[req.rank].of[req.id]
        req.drafts = speculative.take_drafts(self._state, row, req.num_drafts)

  def stats(self) -> dict:
    return self._acceptance.stats(self.config.num_draft_tokens)

  def release(self) -> None:
    """Drops the device state (`Engine.release`)."""
    self.in_flight.clear()
    self._state = None


def _continue(schedulers, previous: list[list[Scheduled]], K: int):
  """Pipelined blocks for every rank, or None (then the step in flight is
  read first). All ranks continue or none does: each is checked before any
  takes pages. A rank with no work stays idle."""
  plans = []
  for sch, prev in zip(schedulers, previous):
    plan = sch.plan_continue(prev, K) if sch.has_work() else []
    if plan is None:
      return None
    plans.append(plan)
  if not any(plans):
    return None
  return [sch.continue_with(plan, K) for sch, plan in zip(schedulers, plans)]
