"""Step runners: each builds its step's batch from the host core's chunks,
dispatches the jitted program and reads the results back, with its own
queue of steps in flight. `Engine.step` calls its runner's `dispatch`, then
its `read`.

  PlainRunner  `steps.step` (`steps.decode_steps`): one sampled token per
               sequence whose chunk reaches its end (every DP rank steps)
  SpecRunner   `speculative.spec_step` (in `engine/spec_runner.py`)

A runner holds the `engine.core.HostCore` it schedules and its own host
state (the queue, the device-side previous samples or draft state, its
counters), never the Engine. The Engine's device state goes in explicitly
on each call, what the step reads as a `StepModel` (params and their
placement) and what it donates as arguments (the page pool and the expert
load); the runner returns the new pool and load, and the Engine keeps them.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine import images, logprobs, sampling, sampling_extras, steps
from jaxinfer.engine.core import HostCore
from jaxinfer.engine.ranks import Ranks
from jaxinfer.engine.scheduler import Scheduled

Events = list[tuple[int, list[int], bool]]  # (request id, new token ids, finished)


@dataclasses.dataclass(frozen=True)
class StepModel:
  """What an Engine's steps run: the model config, the params in the step's
  layout (`Engine._set_params`) and how they are placed: ep, the experts'
  plan (`moe_ep.plan_from_params`); ranks, the attention-DP ranks
  (`ranks.Ranks`, None without attention DP); heads, {mesh, head_axis}
  when a mesh axis splits the attention heads (`sharding.head_axis`), else
  {}. The Engine makes one per params (`rebalance` makes another)."""
  cfg: ModelConfig
  params: object
  ep: object = None
  ranks: Ranks | None = None
  heads: dict = dataclasses.field(default_factory=dict)


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
  samples are read; the tokens it needs from step N come from the device.
  images: the Engine's `images.Images` (a step's visual rows)."""

  def __init__(self, core: HostCore, images: images.Images):
    self.core, self.images = core, images
    self.counts = StepCounts()
    self.in_flight: collections.deque[PlainInFlight] = collections.deque()
    self._prev_sampled = jnp.zeros((core.num_ranks, core.config.max_num_seqs), jnp.int32)
    # The last dispatch's samples, every decode step of a multi-step one:
    # where penalties find the tokens still in flight (`sampling_extras`).
    self._prev_out = self._prev_sampled
    self._keep = 0  # steps `read` leaves in flight

  def dispatch(self, model: StepModel, pool, load):
    """Schedules every rank and dispatches their step (when any has a chunk)
    -> (new pool, new load)."""
    core = self.core
    per_rank = core.schedule_ranks([0] * core.num_ranks)
    scheduled = any(per_rank)
    self._keep = 1 if scheduled and core.config.async_scheduling else 0
    if scheduled:
      t0 = time.perf_counter()
      n = core.config.decode_steps
      multi = multi_step(core.schedulers, per_rank, n)
      if multi is None:
        return self._dispatch(model, pool, load, per_rank, t0)
      return self._dispatch(model, pool, load, multi, t0, n)
    return pool, load

  def read(self) -> Events:
    """Reads the steps in flight but, with async scheduling, the one
    `dispatch` just dispatched -> their events."""
    return self._read(self._keep)

  def warm(self, model: StepModel, pool, load, programs) -> tuple[int, object, object]:
    """Compiles each program ((shapes, decode steps, greedy, k_cap), as
    `warmup.programs` lists them) by running it on all-padding batches,
    leaving the counters other than the compiled programs as they were
    (`Engine.warmup`). -> (programs compiled now, new pool, new load)."""
    before = dataclasses.replace(self.counts, programs=set())
    known = len(self.counts.programs)
    idle = [[] for _ in range(self.core.num_ranks)]
    for shapes, n, greedy, k_cap in programs:
      pool, load = self._dispatch(model, pool, load, idle, time.perf_counter(), n,
                                  program=(shapes, greedy, k_cap))
      self._read(keep=0)
    compiled = self.counts.programs
    self.counts = dataclasses.replace(before, programs=compiled)
    return len(compiled) - known, pool, load

  def _dispatch(self, model: StepModel, pool, load, per_rank, t0: float, n: int = 1,
                program=None):
    """One program over every rank's chunks: a step, or n decode steps
    (`steps.decode_steps`) of `multi_step`'s chunks -> (new pool, new load).
    program: (shapes, greedy, k_cap) for chunks that do not say (`warm`'s
    empty ones)."""
    core = self.core
    busy = [sch for sch in per_rank if sch]
    shapes, greedy, k_cap = program or (core.step_shapes(busy, core.chunk), *sampler_mode(busy))
    batches = [rank_batch(sch, shapes) for sch in per_rank]
    want = logprobs.wanted([s for scheduled in busy for s in scheduled])
    extras = sampling_extras.step_extras(per_rank, shapes.seqs, core.config.max_num_seqs,
                                         self._prev_out)
    batch = steps.stack_batches([b for b, _ in batches])
    args = (model.cfg, model.params, pool, batch, self._prev_sampled, load)
    kw = dict(ep=model.ep, greedy=greedy, k_cap=k_cap, logprobs=want[0], extras=extras,
              ranks=model.ranks, **model.heads)
    if n > 1:  # decode rows only: no prompt rows to score
      sampled, pool, load, lp = steps.decode_steps(*args, num_steps=n, **kw)
      self._prev_sampled = sampled[-1]
    else:
      visual = self.images.step_visual(per_rank, shapes.tokens)
      targets = logprobs.step_targets(per_rank, shapes.tokens) if want[1] else None
      sampled, pool, load, lp = steps.step(*args, visual, targets, max_q=shapes.max_q, **kw)
      self._prev_sampled = sampled
    self._prev_out = sampled
    for sch, rank_scheduled in zip(core.schedulers, per_rank):
      sch.on_dispatch(rank_scheduled)
    self.counts.record((shapes, n, greedy, want, sampling_extras.program_key(extras), k_cap),
                       n * sum(k for _, k in batches),
                       bool(self.in_flight), time.perf_counter() - t0, n)
    self.in_flight.append(PlainInFlight(per_rank, sampled, n, lp))
    return pool, load

  def _read(self, keep: int) -> Events:
    """Reads the steps in flight, oldest first, leaving `keep`."""
    events, n = [], self.core.num_ranks
    while len(self.in_flight) > keep:
      done = self.in_flight.popleft()
      # The one device-to-host read: the tokens, and their logprobs if computed.
      sampled, lp = jax.device_get((done.sampled, done.logprobs))
      # -> [ranks, S, steps]: row b's tokens (one unless a multi-step decode)
      sampled = np.moveaxis(np.asarray(sampled).reshape(done.steps, n, -1), 0, -1)
      for sch, rank_done, rank_sampled, rank_lp in zip(
          self.core.schedulers, done.per_rank, sampled, logprobs.split_ranks(lp, n, done.steps)):
        events += logprobs.applied(rank_lp, sch.apply, rank_done, rank_sampled[:len(rank_done)])
    return events

  def stats(self) -> dict:
    return {}

  def release(self) -> None:
    """Drops the device state (`Engine.release`)."""
    self.in_flight.clear()
    self._prev_sampled = self._prev_out = None
