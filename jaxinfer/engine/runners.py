"""Step runners: each builds its step's batch from the schedulers' chunks,
dispatches the jitted program and reads the results back, with its own
queue of steps in flight. `Engine` holds one and calls `step(engine)`.

  PlainRunner  `steps.step` (`steps.decode_steps`): one sampled token per
               sequence whose chunk reaches its end (every DP rank steps)
  SpecRunner   `speculative.spec_step` (in `engine/spec_runner.py`)

A runner owns its host state (the queue, the device-side previous samples or
draft state, its counters) and writes the engine's pool and expert load,
which the device steps donate and return.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import images, logprobs, sampling, sampling_extras, steps
from jaxinfer.engine.scheduler import Scheduled

Events = list[tuple[int, list[int], bool]]  # (request id, new token ids, finished)


@dataclasses.dataclass
class StepCounts:
  """What a runner dispatched: steps, their real (unpadded) tokens, steps
  dispatched before the previous one was read, the distinct programs, and
  the host seconds spent dispatching steps whose program was compiled
  already (building the batch and the call; not the first call of a
  program, which compiles it) over the model steps they ran (a multi-step
  decode runs `decode_steps` in one dispatch)."""
  steps: int = 0
  tokens: int = 0
  overlapped: int = 0
  programs: set = dataclasses.field(default_factory=set)
  host_s: float = 0.0
  host_steps: int = 0

  def record(self, program, num_tokens: int, overlapped: bool, host_s: float,
             model_steps: int = 1) -> None:
    if program in self.programs:
      self.host_s += host_s
      self.host_steps += model_steps
    self.programs.add(program)
    self.steps += 1
    self.tokens += num_tokens
    self.overlapped += overlapped


def sampling_fields(reqs) -> dict:
  """Per-request sampling fields, as the step batches take them."""
  return dict(temperature=[r.sampling.temperature for r in reqs],
              top_k=[r.sampling.top_k for r in reqs], top_p=[r.sampling.top_p for r in reqs],
              seeds=[r.sampling.seed % (1 << 32) for r in reqs])


def all_greedy(scheduled) -> bool:
  """Every request of the chunks has temperature 0 (the step skips sampling)."""
  return all(s.request.sampling.temperature == 0 for s in scheduled)


def sampler_mode(busy) -> tuple[bool, int]:
  """A step's static sampling arguments over its ranks' chunks: (greedy,
  k_cap) as `steps.step` and `speculative.spec_step` take them."""
  chunks = [s for scheduled in busy for s in scheduled]
  greedy = all_greedy(chunks)
  return greedy, 0 if greedy else sampling.top_k_cap(s.request.sampling for s in chunks)


def rank_batch(scheduled: list[Scheduled], shapes: steps.StepShapes):
  """One rank's chunks -> (padded `StepBatch`, real tokens). A token sampled
  by the step still in flight is taken on device from its row there."""
  tokens, from_prev, positions, token_seq = [], [], [], []
  for i, s in enumerate(scheduled):
    req = s.request
    known = req.tokens
    for pos in range(s.start, s.start + s.num_tokens):
      if pos < len(known):
        tokens.append(known[pos])
        from_prev.append(-1)
      else:  # sampled by the previous step, not read back yet
        tokens.append(0)
        from_prev.append(req.pending_row)
    positions += range(s.start, s.start + s.num_tokens)
    token_seq += [i] * s.num_tokens
  reqs = [s.request for s in scheduled]
  return steps.pad_batch(
      shapes, tokens=tokens, from_prev=from_prev, positions=positions, token_seq=token_seq,
      q_lens=[s.num_tokens for s in scheduled],
      kv_lens=[s.start + s.num_tokens for s in scheduled],
      page_tables=[r.pages for r in reqs], **sampling_fields(reqs),
      sample_idx=[len(r.output) + r.pending for r in reqs],
      rope_positions=images.step_rope(scheduled)), len(tokens)


def multi_step(schedulers, per_rank, n: int):
  """Every rank's chunks as n-step decodes (`Scheduler.plan_decode`, then
  `take_decode` once every rank can: an idle rank is all padding), or None."""
  if n < 2:
    return None
  plans = [sch.plan_decode(scheduled, n) for sch, scheduled in zip(schedulers, per_rank)]
  if any(p is None for p in plans):
    return None
  return [sch.take_decode(scheduled, p, n)
          for sch, scheduled, p in zip(schedulers, per_rank, plans)]


@dataclasses.dataclass(frozen=True)
class PlainInFlight:
  """A dispatched plain step: each rank's chunks and the samples on device,
  [n, S] ([steps, n, S] for a multi-step decode; row b: chunk b), and their
  logprobs if computed."""
  per_rank: list[list[Scheduled]]
  sampled: jax.Array
  steps: int = 1
  logprobs: dict | None = None


class PlainRunner:
  """Plain steps on every rank together (an idle rank on an all-padding
  batch). With async scheduling step N + 1 is dispatched before step N's
  samples are read; the tokens it needs from step N come from the device."""

  def __init__(self, eng):
    self.counts = StepCounts()
    self.in_flight: collections.deque[PlainInFlight] = collections.deque()
    S = eng.config.max_num_seqs
    self._prev_sampled = jnp.zeros((eng.num_ranks, S), jnp.int32)
    # The last dispatch's samples, every decode step of a multi-step one:
    # where penalties find the tokens still in flight (`sampling_extras`).
    self._prev_out = self._prev_sampled

  def step(self, eng) -> Events:
    per_rank = eng.schedule_ranks([0] * eng.num_ranks)
    scheduled = any(per_rank)
    if scheduled:
      t0 = time.perf_counter()
      multi = multi_step(eng.schedulers, per_rank, eng.config.decode_steps)
      if multi is None:
        self._dispatch(eng, per_rank, t0)
      else:
        self._dispatch(eng, multi, t0, eng.config.decode_steps)
    return self._read(eng, keep=1 if scheduled and eng.config.async_scheduling else 0)

  def warm(self, eng, shapes: steps.StepShapes, n: int, greedy: bool, k_cap: int) -> None:
    """Compiles one program (`engine.warmup`): runs it on all-padding batches."""
    self._dispatch(eng, [[] for _ in range(eng.num_ranks)], time.perf_counter(), n,
                   program=(shapes, greedy, k_cap))
    self._read(eng, keep=0)

  def _dispatch(self, eng, per_rank, t0: float, n: int = 1, program=None) -> None:
    """One program over every rank's chunks: a step, or n decode steps
    (`steps.decode_steps`) of `multi_step`'s chunks. program: (shapes,
    greedy, k_cap) for chunks that do not say (`warm`'s empty ones)."""
    busy = [sch for sch in per_rank if sch]
    shapes, greedy, k_cap = program or (eng.step_shapes(busy, eng._chunk), *sampler_mode(busy))
    batches = [rank_batch(sch, shapes) for sch in per_rank]
    want = logprobs.wanted([s for scheduled in busy for s in scheduled])
    extras = sampling_extras.step_extras(per_rank, shapes.seqs, eng.config.max_num_seqs,
                                         self._prev_out)
    batch = steps.stack_batches([b for b, _ in batches])
    args = (eng.cfg, eng._step_params, eng.pool, batch, self._prev_sampled, eng._load)
    kw = dict(ep=eng._ep, greedy=greedy, k_cap=k_cap, logprobs=want[0], extras=extras,
              ranks=eng.step_ranks, **eng._heads)
    if n > 1:  # decode rows only: no prompt rows to score
      sampled, eng.pool, eng._load, lp = steps.decode_steps(*args, num_steps=n, **kw)
      self._prev_sampled = sampled[-1]
    else:
      visual = eng.images.step_visual(per_rank, shapes.tokens)
      targets = logprobs.step_targets(per_rank, shapes.tokens) if want[1] else None
      sampled, eng.pool, eng._load, lp = steps.step(*args, visual, targets, max_q=shapes.max_q,
                                                    **kw)
      self._prev_sampled = sampled
    self._prev_out = sampled
    for sch, rank_scheduled in zip(eng.schedulers, per_rank):
      sch.on_dispatch(rank_scheduled)
    self.counts.record((shapes, n, greedy, want, sampling_extras.program_key(extras), k_cap),
                       n * sum(k for _, k in batches),
                       bool(self.in_flight), time.perf_counter() - t0, n)
    self.in_flight.append(PlainInFlight(per_rank, sampled, n, lp))

  def _read(self, eng, keep: int) -> Events:
    """Reads the steps in flight, oldest first, leaving `keep`."""
    events = []
    while len(self.in_flight) > keep:
      done = self.in_flight.popleft()
      # The one device-to-host read: the tokens, and their logprobs if computed.
      sampled, lp = jax.device_get((done.sampled, done.logprobs))
      # -> [ranks, S, steps]: row b's tokens (one unless a multi-step decode)
      sampled = np.moveaxis(np.asarray(sampled).reshape(done.steps, eng.num_ranks, -1), 0, -1)
      for sch, rank_done, rank_sampled, rank_lp in zip(
          eng.schedulers, done.per_rank, sampled,
          logprobs.split_ranks(lp, eng.num_ranks, done.steps)):
        events += logprobs.applied(rank_lp, sch.apply, rank_done, rank_sampled[:len(rank_done)])
    return events

  def stats(self) -> dict:
    return {}

  def release(self) -> None:
    """Drops the device state (`Engine.release`)."""
    self.in_flight.clear()
    self._prev_sampled = self._prev_out = None
