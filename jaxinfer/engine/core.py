"""The engine's host core: requests, one `Scheduler` + `PageAllocator` per
attention-DP rank, the rank choice, the KV hand-over bookkeeping of
disaggregated serving.

`HostCore` is a plain object, without devices. `Engine` holds one and runs
it on devices; the cluster simulator's `SimEngine` (`jaxinfer/sim/`) holds
one and steps it with modelled step times, so what it schedules, admits,
reserves and pads is the engine's own code; `RemoteEngine` holds one for the
engine's request checks in a serving driver. The holders forward the host
API the serving flow calls to their core (`forward`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import numpy as np

from jaxinfer.engine.sampling import SamplingParams, TokenLogprobs
from jaxinfer.engine.scheduler import Request, Scheduler, capacity_error
from jaxinfer.kv.allocator import PageAllocator


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
  """Per-request timings (seconds, wall clock on the host) and token counts."""

  ttft_s: float | None  # submit -> first token
  tpot_s: float | None  # mean time per output token after the first
  prompt_tokens: int
  cached_prompt_tokens: int  # served from the prefix cache
  computed_prompt_tokens: int  # prompt tokens computed (more than uncached after a preemption)
  generated_tokens: int
  preemptions: int
  queue_s: float | None = None  # submit -> first scheduled (None: not yet, or prefilled elsewhere)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """What a request produced so far: its tokens, why it stopped, its metrics;
  with `SamplingParams.logprobs`, one `TokenLogprobs` per token; with
  `prompt_logprobs`, one per prompt token (None for the first)."""

  request_id: int
  prompt_token_ids: list[int]
  token_ids: list[int]
  finish_reason: str | None  # "stop" | "length" | "abort"; None while running
  metrics: RequestMetrics
  logprobs: list[TokenLogprobs] | None = None
  prompt_logprobs: list[TokenLogprobs | None] | None = None


def prefill_chunk(config) -> int:
  """The prompt chunk an `EngineConfig`'s steps prefill in (the token budget at most)."""
  return min(config.prefill_chunk_size or config.max_num_batched_tokens,
             config.max_num_batched_tokens)


class HostCore:
  """Requests over per-rank schedulers and page allocators (no devices).

  A plain object that `Engine` and the simulator's `SimEngine` each hold as
  `core` and step their own way (schedule, dispatch, apply); `RemoteEngine`
  holds one for its request checks. config: an `EngineConfig`; num_pages:
  each rank's pool size. pick_rank: a callable () -> the rank of a new
  request (None: the least-loaded rank, `Scheduler.load`)."""

  def __init__(self, config, *, num_ranks: int, num_pages: int, max_model_len: int,
               vocab_size: int, eos_ids: Sequence[int], pick_rank=None) -> None:
    self.config, self.num_ranks, self.max_model_len = config, num_ranks, max_model_len
    self.max_pages_per_seq = -(-max_model_len // config.page_size)
    self.vocab_size, self.eos_ids = vocab_size, frozenset(eos_ids)
    self.spec = config.speculative
    self.allocators = [PageAllocator(num_pages, config.page_size,
                                     prefix_caching=config.enable_prefix_caching)
                       for _ in range(num_ranks)]
    self.allocator = self.allocators[0]
    self.chunk = prefill_chunk(config)
    self.schedulers = [Scheduler(a, max_num_seqs=config.max_num_seqs,
                                 max_num_batched_tokens=config.max_num_batched_tokens,
                                 prefill_chunk_size=self.chunk, max_model_len=max_model_len)
                       for a in self.allocators]
    self.scheduler = self.schedulers[0]
    self.requests: dict[int, Request] = {}
    self._next_id = 0
    self._rank_policy = pick_rank

  # ------------------------------------------------------------ requests

  def check_request(self, prompt, sampling) -> tuple[list[int], SamplingParams]:
    """Validates a request without queueing it -> (token ids, sampling)."""
    if sampling is None:
      sampling = SamplingParams()
    if not isinstance(sampling, SamplingParams):
      raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    arr = np.asarray(prompt)
    if arr.ndim != 1 or arr.size == 0:
      raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise TypeError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= self.vocab_size:
      raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got min {lo}, max {hi}")
    self._check_extras(sampling)
    why = capacity_error(arr.size, sampling.max_tokens, max_model_len=self.max_model_len,
                         page_size=self.config.page_size,
                         usable_pages=self.allocator.usable_pages)
    if why:
      raise ValueError(why)
    return arr.astype(np.int64).tolist(), sampling

  def _check_extras(self, sampling: SamplingParams) -> None:
    """The request's extras against this engine: logit_bias ids in the
    vocabulary; none but ignore_eos under speculation (its verify and draft
    steps do not process logits)."""
    bad = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
    if bad:
      raise ValueError(f"SamplingParams: logit_bias token ids must be in [0, {self.vocab_size}), "
                       f"got {bad[0]}")
    if self.spec is not None and sampling.uses_extras:
      named = [n for n, on in (("min_tokens", sampling.min_tokens),
                               ("logit_bias", sampling.logit_bias),
                               ("repetition_penalty", sampling.repetition_penalty != 1),
                               ("presence_penalty", sampling.presence_penalty),
                               ("frequency_penalty", sampling.frequency_penalty)) if on]
      raise ValueError(f"SamplingParams: {', '.join(named)} not supported with speculative "
                       f"decoding (EngineConfig.speculative); ignore_eos is")

  def submit(self, prompt: Sequence[int], sampling: SamplingParams | None = None, *,
             hold_pages: bool = False) -> int:
    """Queues a request; returns its id. Raises on bad input, queueing nothing.
    hold_pages: when it finishes (not on abort), its KV pages stay allocated
    for `take_pages` (a disaggregated prefill hands them to a decode worker)."""
    return self.enqueue(*self.check_request(prompt, sampling), hold_pages=hold_pages)

  def enqueue(self, tokens: list[int], sampling: SamplingParams, **fields) -> int:
    """Queues a checked request (`check_request`'s output) on its rank ->
    its id. fields: more `Request` fields (hold_pages, mm)."""
    req = self._new_request(tokens, sampling, **fields)
    self.schedulers[req.rank].add(req)
    return req.id

  def _new_request(self, tokens: list[int], sampling: SamplingParams, **fields) -> Request:
    stop = set(sampling.stop_token_ids)
    if not (self.config.ignore_eos or sampling.ignore_eos):
      stop |= self.eos_ids
    rid = self._next_id
    self._next_id += 1
    fields.setdefault("rank", self.pick_rank())
    fields.setdefault("logprobs", None if sampling.logprobs is None else [])
    fields.setdefault("prompt_logprobs", None if sampling.prompt_logprobs is None else [None])
    req = Request(id=rid, prompt=tokens, sampling=sampling, stop_ids=frozenset(stop), **fields)
    self.requests[rid] = req
    return req

  def pick_rank(self) -> int:
    """The DP rank of a new request: the one with the least work
    (`Scheduler.load`), unless the core was given its own policy."""
    if self._rank_policy is not None:
      return self._rank_policy()
    return min(range(self.num_ranks), key=lambda r: self.schedulers[r].load())

  def abort(self, request_id: int) -> RequestOutput:
    """Stops a request, freeing its pages; returns what it produced."""
    req = self.requests.get(request_id)
    if req is None:
      raise ValueError(f"abort: unknown request_id {request_id}")
    if not req.finished:
      self.schedulers[req.rank].finish(req, "abort")
    return self.output(request_id)

  def fail_unfinished(self) -> list[int]:
    """Ends every queued or running request with finish_reason "error"
    (a step failed), freeing its pages. -> their ids."""
    ended = [r for s in self.schedulers for r in (*s.running, *s.waiting)]
    for req in ended:
      self.schedulers[req.rank].finish(req, "error")
    return [r.id for r in ended]

  def has_unfinished(self) -> bool:
    """Whether any request is queued or running."""
    return any(s.has_work() for s in self.schedulers)

  def output(self, request_id: int) -> RequestOutput:
    """The request's `RequestOutput` now (finished or not)."""
    req = self.requests[request_id]
    tpot = None
    if req.finish_s is not None and len(req.output) > 1:
      tpot = (req.finish_s - req.first_token_s) / (len(req.output) - 1)
    ttft = None if req.first_token_s is None else req.first_token_s - req.arrival_s
    metrics = RequestMetrics(ttft_s=ttft, tpot_s=tpot, prompt_tokens=len(req.prompt),
                             cached_prompt_tokens=req.cached_prompt_tokens,
                             computed_prompt_tokens=req.prefill_computed,
                             generated_tokens=len(req.output), preemptions=req.preemptions,
                             queue_s=(None if req.admitted_s is None
                                      else req.admitted_s - req.arrival_s))
    copy = lambda entries: None if entries is None else list(entries)
    return RequestOutput(request_id=req.id, prompt_token_ids=list(req.prompt),
                         token_ids=list(req.output), finish_reason=req.finish_reason,
                         metrics=metrics, logprobs=copy(req.logprobs),
                         prompt_logprobs=copy(req.prompt_logprobs))

  def logprobs_tail(self, request_id: int, count: int) -> tuple[list | None, list | None]:
    """The logprobs of the request's last `count` tokens and its prompt
    logprobs (None where not asked), without copying the whole output:
    streaming reads these each step."""
    req = self.requests[request_id]
    tail = None if req.logprobs is None else req.logprobs[len(req.output) - count:]
    return tail, req.prompt_logprobs

  def stats(self, counts) -> dict:
    """The host's counters (`Engine.stats`); counts: the step runner's `StepCounts`."""
    allocs, reqs = self.allocators, self.requests.values()
    return dict(
        steps=counts.steps,
        tokens_per_step=counts.tokens / max(counts.steps, 1),
        compiles=len(counts.programs),
        kv_pages_total=sum(a.usable_pages for a in allocs),
        kv_pages_used=sum(a.num_used() for a in allocs),
        kv_pages_cached=sum(a.num_cached() for a in allocs),
        kv_pages_free=sum(len(a.free) for a in allocs),
        preemptions=sum(s.num_preemptions for s in self.schedulers),
        prompt_tokens=sum(len(r.prompt) for r in reqs),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in reqs),
        running=sum(len(s.running) for s in self.schedulers),
        waiting=sum(len(s.waiting) for s in self.schedulers),
        overlapped_steps=counts.overlapped, dp_ranks=self.num_ranks,
        host_ms_per_step=1e3 * counts.host_s / max(counts.host_steps, 1),
        requests_per_rank=[sum(r.rank == k for r in reqs) for k in range(self.num_ranks)])

  # ------------------------------------------------------------ KV hand-over

  def take_pages(self, request_id: int) -> tuple[int, list[int]]:
    """A finished request submitted with hold_pages: -> (rank, its KV pages
    in token order), now the caller's to `read_pages` and `release_pages`."""
    req = self.requests.get(request_id)
    if req is None or not req.hold_pages:
      raise ValueError(f"take_pages: request {request_id} was not submitted with hold_pages")
    if not req.finished:
      raise ValueError(f"take_pages: request {request_id} has not finished")
    pages, req.pages = req.pages, []
    return req.rank, pages

  def take_drafts(self, request_id: int):
    """A finished held request's MTP drafts (its draft-state row, device
    arrays) for the decode side, or None (no speculation here). The first
    decode step then verifies them, as it would on one engine."""
    req = self.requests.get(request_id)
    if req is None or not req.hold_pages:
      raise ValueError(f"take_drafts: request {request_id} was not submitted with hold_pages")
    drafts, req.drafts = req.drafts, None
    return drafts

  def release_pages(self, rank: int, pages) -> None:
    self.allocators[rank].release(pages)

  def reserve_pages(self, num_tokens: int) -> tuple[int, list[int]] | None:
    """Pages for num_tokens of K/V on the least-loaded rank, taken now (the
    decode side of a disaggregated prefill reserves first). None if the pool
    cannot spare them."""
    rank = self.pick_rank()
    pages = self.allocators[rank].allocate(-(-num_tokens // self.config.page_size))
    return None if pages is None else (rank, pages)

  def submit_prefilled(self, prompt: Sequence[int], first_token: int,
                       sampling: SamplingParams | None, rank: int, pages: list[int], *,
                       arrival_s: float | None = None, first_token_s: float | None = None,
                       drafts=None, first_logprobs: TokenLogprobs | None = None) -> int:
    """Queues a request whose prompt K/V is already in `pages` (reserved on
    `rank`, then written) and whose first token was sampled elsewhere; it
    decodes from there. The pages become the request's. drafts: the prefill
    side's `take_drafts`, placed here (speculation: the first step verifies
    them); ignored without speculation. Logprobs are not carried over: with
    `sampling.logprobs` the first token's entry is first_logprobs (the
    prefill side's `RequestOutput.logprobs[0]`; None if not given), and
    `prompt_logprobs` are None here (the prompt was computed elsewhere)."""
    tokens, sampling = self.check_request(prompt, sampling)
    if not 0 <= int(first_token) < self.vocab_size:
      raise ValueError(f"submit_prefilled: first_token {first_token} is out of the vocabulary "
                       f"[0, {self.vocab_size})")
    if sampling.max_tokens < 2:
      raise ValueError("submit_prefilled: max_tokens < 2 leaves nothing to decode after the "
                       "first token")
    if len(pages) * self.config.page_size < len(tokens):
      raise ValueError(f"submit_prefilled: {len(pages)} pages hold fewer than the prompt's "
                       f"{len(tokens)} tokens")
    now = time.perf_counter()
    req = self._new_request(tokens, sampling, rank=rank, pages=list(pages),
                            num_computed=len(tokens), output=[int(first_token)], admitted=True,
                            arrival_s=now if arrival_s is None else arrival_s,
                            first_token_s=now if first_token_s is None else first_token_s,
                            logprobs=None if sampling.logprobs is None else [first_logprobs],
                            prompt_logprobs=None)
    if drafts is not None and self.spec is not None:
      req.drafts, req.num_drafts = drafts, int(drafts["drafts"].shape[0])
    self.schedulers[rank].add(req)
    return req.id


def forward(name: str):
  """A method of a `HostCore` holder (`Engine`, `SimEngine`) that calls its
  core's (`holder.core.<name>`), with that method's signature and docstring."""

  @functools.wraps(getattr(HostCore, name))
  def method(self, *args, **kwargs):
    return getattr(self.core, name)(*args, **kwargs)
  return method


def forward_attribute(name: str) -> property:
  """A read-only attribute of a `HostCore` holder: its core's `<name>`."""
  return property(lambda self: getattr(self.core, name),
                  doc=f"The host core's `{name}` (`engine.core.HostCore`).")
