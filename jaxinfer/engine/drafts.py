"""MTP speculation's host side, which `steps.Runner` holds as its drafts:
the draft-state slot of each running request (`DraftSlots`), the
acceptance counters (`Acceptance`), the device draft state (each rank its
block of rows, sharded like the pool's pages under attention DP) and the
speculative batch (`spec_batch`: a decode block is [last token, K draft
rows], the drafts' values on device).

With async scheduling a decode-only batch is pipelined: the next step is
dispatched before the one in flight is read, its last tokens and positions
left to the device (`Scheduler.plan_continue`, `continue_with`). Anything else
(admissions, prefill chunks, preemption, a new draft budget K) reads the
step in flight first and schedules as usual, with K as the draft budget.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from jaxinfer.engine import scheduler, speculative, steps
from jaxinfer.engine.core import HostCore
from jaxinfer.engine.scheduler import Scheduled
from jaxinfer.engine.steps import StepModel, sampling_fields


class Drafts:
  """The draft state [ranks * slots, K] on device between steps (each rank
  owns its rows of it and its own slot map) with its host bookkeeping."""

  def __init__(self, core: HostCore, model: StepModel):
    self.config = core.spec
    K, S = self.config.num_draft_tokens, core.config.max_num_seqs
    self.state = speculative.init_state(model.cfg, core.num_ranks * S, K)
    self._slots = [DraftSlots(S) for _ in range(core.num_ranks)]
    self._acceptance = Acceptance(K)
    if model.ranks is not None:  # each rank's block of rows on its devices
      self.state = jax.device_put(self.state,
                                  NamedSharding(model.ranks.mesh, P(model.ranks.axes)))

  def decoder(self, K: int) -> speculative.Mtp:
    return speculative.Mtp(K)

  def schedule(self, core: HostCore, in_flight, read):
    """Continues the step in flight (pipelined) or reads it (read(keep=0))
    and schedules anew -> (every rank's chunks, K, the events read)."""
    K = min(core.spec_draft_tokens(sch) for sch in core.schedulers)
    per_rank, events = None, []
    if in_flight and core.config.async_scheduling and in_flight[-1].decoder.k == K:
      per_rank = _continue(core.schedulers, in_flight[-1].per_rank, K)
    if per_rank is None:
      events = read(keep=0)
      per_rank = scheduler.schedule_ranks(core.schedulers, [K] * core.num_ranks, core.config)
      for slots, sch, scheduled in zip(self._slots, core.schedulers, per_rank):
        slots.assign(sch.running, scheduled)
      self._place_arrived(per_rank, core.config.max_num_seqs)
    return per_rank, K, events

  def _place_arrived(self, per_rank, slots_per_rank: int) -> None:
    """Writes the drafts that came with hand-over requests into their new slots."""
    for rank, (slots, scheduled) in enumerate(zip(self._slots, per_rank)):
      for s in scheduled:
        if s.request.drafts is not None:
          row = rank * slots_per_rank + slots.of[s.request.id]
          self.state = speculative.put_drafts(self.state, row, s.request.drafts)
          s.request.drafts = None

  def batch(self, core: HostCore, per_rank, shapes: steps.StepShapes):
    """Every rank's chunks -> (`SpecBatch.pack()` arrays stacked [n, ...], real tokens)."""
    built = [spec_batch(scheduled, shapes, slots.of, page_size=core.config.page_size,
                        max_model_len=core.max_model_len)
             for scheduled, slots in zip(per_rank, self._slots)]
    return (tuple(np.stack(fields) for fields in zip(*(b.pack() for b, _ in built))),
            sum(n for _, n in built))

  def after_read(self, scheduled: list[Scheduled], rows, counts) -> tuple:
    """A read step's rows of one rank ((tokens, emitted, verified), `Mtp.rows`):
    counts the acceptance and the drafts cut on device at max_len ->
    `Scheduler.apply`'s (tokens, emitted, K)."""
    out, n_emit, n_verified = rows
    for s, n, d in zip(scheduled, n_emit, n_verified):
      counts.tokens -= s.num_draft - int(d)  # drafts cut on device at max_len
      if s.samples and s.num_draft and not s.request.finished:
        self._acceptance.record(int(d), int(n))
    return out, n_emit, out.shape[1] - 1

  def keep_handover(self, core: HostCore, scheduled: list[Scheduled]) -> None:
    """Held requests that finished (a disaggregated prefill): snapshot their
    draft-state row now, before the slot can go to another request."""
    for s in scheduled:
      req = s.request
      if req.hold_pages and req.finish_reason not in (None, "abort") and req.num_drafts:
        row = req.rank * core.config.max_num_seqs + self._slots[req.rank].of[req.id]
        req.drafts = speculative.take_drafts(self.state, row, req.num_drafts)

  def stats(self) -> dict:
    return self._acceptance.stats(self.config.num_draft_tokens)


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
