"""The speculative step runner: MTP draft-and-verify steps
(`speculative.spec_step`) on one rank, with the draft-state slot of each
running request and the acceptance counters.

With async scheduling a decode-only batch is pipelined: the next step is
dispatched before the one in flight is read, its last tokens and positions
left to the device (`Scheduler.continue_speculative`). Anything else
(admissions, prefill chunks, preemption, a new draft budget K) reads the
step in flight first and schedules as usual, with K as the draft budget.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from jaxinfer.engine import speculative, steps
from jaxinfer.engine.runners import Events, StepCounts, all_greedy, sampling_fields
from jaxinfer.engine.scheduler import Scheduled


@dataclasses.dataclass(frozen=True)
class SpecInFlight:
  """A dispatched speculative step: its chunks, emitted [B, K + 3] on device
  (`spec_step`'s output) and its draft budget K."""
  scheduled: list[Scheduled]
  emitted: jax.Array
  K: int


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
  """Speculative MTP steps (one rank: the Engine refuses speculation under
  attention DP). The draft state [slots, K] lives on device between steps."""

  def __init__(self, eng):
    self.config = eng.config.speculative
    self.counts = StepCounts()
    self.in_flight: collections.deque[SpecInFlight] = collections.deque()
    K = self.config.num_draft_tokens
    self._state = speculative.init_state(eng.cfg, eng.config.max_num_seqs, K)
    self._slots = DraftSlots(eng.config.max_num_seqs)
    self._acceptance = Acceptance(K)

  def step(self, eng) -> Events:
    sch = eng.scheduler
    K = eng.spec_draft_tokens(sch)
    scheduled = None
    if self.in_flight and eng.config.async_scheduling and self.in_flight[-1].K == K:
      scheduled = sch.continue_speculative(self.in_flight[-1].scheduled, K)
    events = []
    if scheduled is None:
      events += self._read(eng, keep=0)
      scheduled = sch.schedule(K)
      self._slots.assign(sch.running, scheduled)
    if scheduled:
      self._dispatch(eng, scheduled, K)
    keep = 1 if scheduled and eng.config.async_scheduling else 0
    return events + self._read(eng, keep)

  def _dispatch(self, eng, scheduled: list[Scheduled], K: int) -> None:
    shapes = eng.step_shapes([scheduled], eng._chunk + K)
    batch, n_tokens = spec_batch(scheduled, shapes, self._slots.of,
                                 page_size=eng.config.page_size, max_model_len=eng.max_model_len)
    greedy = all_greedy(scheduled)
    emitted, eng.pool, self._state, eng._load = speculative.spec_step(
        eng.cfg, eng._step_params, eng.pool, batch.pack(), self._state, eng._load,
        max_q=shapes.max_q, K=K, ep=eng._ep, greedy=greedy, **eng._heads)
    eng.scheduler.on_dispatch(scheduled)
    self.counts.record((shapes, K, greedy), n_tokens, bool(self.in_flight))
    self.in_flight.append(SpecInFlight(scheduled, emitted, K))

  def _read(self, eng, keep: int) -> Events:
    """Reads the steps in flight, oldest first, leaving `keep`."""
    events = []
    while len(self.in_flight) > keep:
      done = self.in_flight.popleft()
      K = done.K
      emitted = np.asarray(done.emitted)  # the one device-to-host read
      out, n_emit, n_verified = emitted[:, :K + 1], emitted[:, K + 1], emitted[:, K + 2]
      for s, n, d in zip(done.scheduled, n_emit, n_verified):
        self.counts.tokens -= s.num_draft - int(d)  # drafts cut on device at max_len
        if s.samples and s.num_draft and not s.request.finished:
          self._acceptance.record(int(d), int(n))
      events += eng.scheduler.apply_speculative(done.scheduled, out, n_emit, K)
    return events

  def stats(self) -> dict:
    return self._acceptance.stats(self.config.num_draft_tokens)
