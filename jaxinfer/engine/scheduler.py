"""Host scheduler: continuous batching with chunked prefill, prefix caching
and preemption by recompute. Pure Python; no device work.

A request's tokens are prompt + output; `num_computed` of them have K/V in
its pages. Each step schedules, per request, the next chunk of uncomputed
tokens: a decode is simply a chunk of one. When a chunk reaches the end of
the tokens, the step's sample for that request is its next token. So prefill,
chunked prefill, decode and recompute after preemption are one code path.

Per step, under a token budget: running requests first (oldest first), then
waiting ones (FIFO) while pages, budget and sequence slots last. A waiting
prompt that would be split beside another prompt's chunk, though a later
step could hold it whole, waits for that step: its rest would continue past
position 0, where attention reads the pages instead of the step's own keys
(`ops.ragged_paged_attention`'s new_kv). The step then lists its prompt
chunks before its decodes (`prompts_first`). When a running request needs
a page and none is left, the newest running request is preempted: its
pages are released (their hashed prefix stays cached) and it goes back to
the front of the queue to be recomputed. Nothing is dropped.

Async scheduling: the engine dispatches step N+1 before reading step N's
samples. So `num_computed` advances at dispatch (`on_dispatch`), and a request
sampled in a step still in flight has `pending` tokens whose values only the
device knows yet; the next step reads them from the previous step's output.
Results arrive in `apply`. A request certain to finish (max_tokens or the
context reached) is not scheduled again; one that stops on a sampled stop
token may have one more row computed, which `apply` discards. Device steps
run in order on the donated pool, so pages released here and reused by the
next step are never written out of order.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.kv.allocator import PageAllocator, hash_page, page_extra


def bucket(n: int, cap: int, minimum: int = 1) -> int:
  """Smallest power of two >= n (at least `minimum`), capped at `cap`."""
  b = max(minimum, 1 << max(0, int(n - 1).bit_length()))
  return min(b, cap) if n <= cap else n


def capacity_error(prompt_len: int, max_tokens: int, *, max_model_len: int, page_size: int,
                   usable_pages: int) -> str | None:
  """Why a request can never be served (its prompt reaches the context limit,
  or its longest sequence needs more KV pages than the whole pool), or None.
  The Engine raises it; the cluster simulator reports it."""
  if prompt_len >= max_model_len:
    return (f"prompt length {prompt_len} is at or over the context limit "
            f"(max_model_len {max_model_len})")
  pages = -(-min(prompt_len + max_tokens, max_model_len) // page_size)
  if pages > usable_pages:
    return (f"request needs {pages} KV pages (prompt {prompt_len} + max_tokens {max_tokens}), "
            f"more than the whole pool ({usable_pages} pages)")
  return None


# eq=False: requests are identities. The scheduler's `req in self.running`
# checks would otherwise compare every field (prompts included) of every
# running request: quadratic in the batch, 16M comparisons over 544 steps
# of a 256-sequence batch.
@dataclasses.dataclass(eq=False)
class Request:
  id: int
  prompt: list[int]
  sampling: SamplingParams
  stop_ids: frozenset[int]
  output: list[int] = dataclasses.field(default_factory=list)
  num_computed: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  page_hashes: list[bytes] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
  admitted_s: float | None = None  # first scheduled
  first_token_s: float | None = None
  finish_s: float | None = None
  cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
  prefill_computed: int = 0  # prompt tokens this engine computed for the request
  admitted: bool = False
  preemptions: int = 0
  rank: int = 0  # attention-DP rank owning the request and its pages
  pending: int = 0  # sampled tokens still on device
  pending_row: int = -1  # their row in the last dispatched step's samples
  num_drafts: int = 0  # speculative: MTP drafts waiting in the device draft state
  spec_ahead: int = 0  # speculative: tokens of pipelined (from_state) blocks not yet read
  hold_pages: bool = False  # on finishing (not aborting), keep the pages for the caller
  # Speculative hand-over (disaggregated serving): the request's draft-state
  # row (device arrays) taken when a held request finishes on the prefill
  # side, or arrived with it on the decode side until written into a slot.
  drafts: object = None
  # A multimodal prompt (`engine.images.MultimodalPrompt`): its visual
  # tokens' features and MRoPE positions; its images' spans enter the page
  # hashes, so the same text with another image never hits the prefix cache.
  mm: object = None
  # `SamplingParams.logprobs`: one `TokenLogprobs` per output token;
  # `prompt_logprobs`: one per prompt token recorded so far, entry 0 None.
  # None when not asked.
  logprobs: list | None = None
  prompt_logprobs: list | None = None

  @property
  def spans(self) -> tuple:
    """(start, end, content hash) of each image's tokens in the prompt."""
    return self.mm.spans if self.mm is not None else ()

  @property
  def tokens(self) -> list[int]:
    """The known tokens (pending ones excluded)."""
    return self.prompt + self.output

  @property
  def num_known(self) -> int:
    """len(tokens), without building the list."""
    return len(self.prompt) + len(self.output)

  def known(self, lo: int, hi: int) -> list[int]:
    """tokens[lo:hi] without building the whole list (a step reads a few
    tokens of a long context)."""
    p = len(self.prompt)
    if hi <= p:
      return self.prompt[lo:hi]
    if lo >= p:
      return self.output[lo - p:hi - p]
    return self.prompt[lo:] + self.output[:hi - p]

  @property
  def reusable_prefix(self) -> int:
    """Known tokens a prefix-cache hit may cover on admission: all but the
    last (one token is computed to sample from), and none from the first
    prompt row whose logprob is still to record (`prompt_logprobs`: the row
    at position p scores prompt token p + 1)."""
    if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt):
      return len(self.prompt_logprobs) - 1
    return self.num_known - 1

  @property
  def total_len(self) -> int:
    return len(self.prompt) + len(self.output) + self.pending

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None


# A value: never assigned after construction (`dataclasses.replace` makes
# another), hashed and compared by its fields. Not frozen: a frozen
# dataclass's __init__ sets each field through object.__setattr__, 0.9 us a
# chunk against 0.2 us here, 0.18 ms of each 256-sequence step (2-core AMD
# EPYC, 2026-12-06).
@dataclasses.dataclass(unsafe_hash=True, slots=True)
class Scheduled:
  request: Request
  num_tokens: int
  start: int  # first token position of the chunk
  samples: bool  # the chunk reaches the end of the request: its sample is the next token
  num_draft: int = 0  # speculative: drafts verified after the request's last token
  # Speculative pipelining: the block's last token and positions come from the
  # device (the previous step is still in flight); `start` is an upper bound.
  from_state: bool = False
  # Multi-step decode (`EngineConfig.decode_steps`): a one-token sampling
  # chunk decoded this many times in one program, sampling as many tokens.
  steps: int = 1

  @property
  def is_prompt(self) -> bool:
    """More than one token past the drafts: a prompt (or part of one), not
    a decode."""
    return self.num_tokens - self.num_draft > 1


def prompts_first(chunks: list[Scheduled]) -> list[Scheduled]:
  """A step's chunks, prompt chunks first and decodes after them (each in
  its order): a fresh prompt then starts on the step's first row, so
  prompts of whole attention blocks stay aligned to
  `ops.ragged_paged_attention`'s packed blocks (4 decodes before 4 prompts
  of 128 tokens made each query block visit two key blocks; bench_dense at
  budget 544, medians of 8, with `layers.apply_rope`'s one fusion: that
  step 598 -> 566 ms, 4 prompts alone 562 -> 554)."""
  if not any(s.num_tokens - s.num_draft > 1 for s in chunks):
    return chunks  # decodes alone (most steps): in order already
  return sorted(chunks, key=lambda s: not s.is_prompt)


class Scheduler:

  def __init__(self, allocator: PageAllocator, *, max_num_seqs: int, max_num_batched_tokens: int,
               prefill_chunk_size: int, max_model_len: int):
    self.alloc = allocator
    self.max_num_seqs = max_num_seqs
    self.budget = max_num_batched_tokens
    self.chunk = prefill_chunk_size
    self.max_model_len = max_model_len
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.num_preemptions = 0

  # ------------------------------------------------------------ scheduling

  def add(self, req: Request) -> None:
    self.waiting.append(req)

  def load(self) -> int:
    """This rank's work in tokens: tokens still to compute (queued and
    running) plus KV in use. Attention DP places a request on the least
    loaded rank (request counts would ignore how long the requests are)."""
    pending = sum(q.total_len - q.num_computed for q in (*self.waiting, *self.running))
    return pending + self.alloc.num_used() * self.alloc.page_size

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def demand(self, spec_k: int = 0) -> tuple[int, int]:
    """What the next `schedule(spec_k)` would like to run, in tokens, without
    taking anything: (decode rows of running requests whose prompt is
    computed, prefill tokens: chunks of the rest and of the waiting queue),
    each capped by the token budget. Attention DP balances steps by it."""
    decode = prefill = 0
    for req in self.running:
      todo = req.total_len - req.num_computed
      if todo <= 1 and not self._will_finish(req):
        decode += 1 + min(spec_k, req.num_drafts)
      elif todo > 1:
        prefill += min(todo, self.chunk)
    free = self.max_num_seqs - len(self.running)
    for req in list(self.waiting)[:max(free, 0)]:
      prefill += min(req.total_len - req.num_computed, self.chunk)
    return min(decode, self.budget), min(prefill, self.budget)

  def _pages_needed(self, req: Request, n: int) -> int:
    ps = self.alloc.page_size
    return -(-(req.num_computed + n) // ps) - len(req.pages)

  def _preempt(self, req: Request) -> None:
    self.running.remove(req)
    self._register_full_pages(req)  # so its recompute hits the prefix cache
    self.alloc.release(req.pages)
    req.pages, req.page_hashes, req.num_computed = [], [], 0
    req.num_drafts = 0
    req.preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(req)

  def _unmatch(self, req: Request) -> None:  # a waiting request gives its matched prefix back
    self.alloc.release(req.pages)
    req.pages, req.page_hashes, req.num_computed = [], [], 0

  def _will_finish(self, req: Request) -> bool:
    """Certain to finish once its pending token arrives (no more compute)."""
    return req.pending > 0 and (len(req.output) + req.pending >= req.sampling.max_tokens
                                or req.total_len >= self.max_model_len)

  def _chunk(self, req: Request, budget: int, spec_k: int) -> tuple[int, bool, int]:
    """-> (tokens, samples, drafts verified). A speculative decode is the
    last token plus up to spec_k drafts, never past max_tokens or the context."""
    n = min(req.total_len - req.num_computed, budget, self.chunk)
    samples = req.num_computed + n == req.total_len
    d = 0
    if samples and n == 1 and spec_k and req.num_drafts:
      d = min(req.num_drafts, spec_k, budget - 1,
              req.sampling.max_tokens - len(req.output) - req.pending - 1,
              self.max_model_len - req.total_len - 1)
      d = max(d, 0)
    return n + d, samples, d

  def _pages_for(self, req: Request, n: int, samples: bool, spec_k: int) -> int:
    """Pages to add for a chunk of n tokens; a sampling chunk under
    speculation also covers the spec_k - 1 positions the draft chain writes."""
    if samples and spec_k > 1:
      n = min(n + spec_k - 1, self.max_model_len - req.num_computed)
    return self._pages_needed(req, n)

  def schedule(self, spec_k: int = 0, budget: int | None = None) -> list[Scheduled]:
    """This step's chunks. spec_k: the draft budget K of a speculative step
    (0: plain): a decode then verifies up to K drafts, and a sampling chunk's
    pages also cover the K - 1 positions the MTP chain drafts past it.
    budget: this step's token budget (None: max_num_batched_tokens; an
    attention-DP step may set a smaller one)."""
    budget, out = min(self.budget, budget or self.budget), []
    preempted = False
    running, i, ps = self.running, 0, self.alloc.page_size
    while i < len(running) and budget > 0:
      req = running[i]
      if self._will_finish(req):
        i += 1
        continue
      if not spec_k and req.total_len - req.num_computed == 1:
        # A plain decode (most chunks): `_chunk` and `_pages_for`, inline.
        n, samples, d, need = 1, True, 0, -(-(req.num_computed + 1) // ps) - len(req.pages)
      else:
        n, samples, d = self._chunk(req, budget, spec_k)
        need = self._pages_for(req, n, samples, spec_k)
      while need > self.alloc.num_available() and req in running:
        self._preempt(running[-1])
        preempted = True
      if preempted and req not in running:  # (a scan only once something was preempted)
        break  # it was the newest, and preempted itself
      if need > 0:
        req.pages += self.alloc.allocate(need)
      out.append(Scheduled(req, n, req.num_computed, samples, d))
      budget -= n
      i += 1
    while (self.waiting and budget > 0 and not preempted
           and len(self.running) < self.max_num_seqs):
      req = self.waiting[0]
      if req.pending:
        break  # preempted while its last sample is in flight: admit once it lands
      tokens = req.tokens
      if not req.pages:
        # Reuse cached full pages (`Request.reusable_prefix`).
        max_pages = req.reusable_prefix // self.alloc.page_size
        req.pages, req.page_hashes = self.alloc.match_prefix(tokens, max_pages, req.spans)
        req.num_computed = len(req.pages) * self.alloc.page_size
      n, samples, d = self._chunk(req, budget, spec_k)
      if n < req.total_len - req.num_computed <= self.chunk and any(s.is_prompt for s in out):
        self._unmatch(req)  # fits a later step whole: not split beside another prompt
        break
      need = self._pages_for(req, n, samples, spec_k)
      if need > self.alloc.num_available():
        self._unmatch(req)  # retry next step
        break
      req.pages += self.alloc.allocate(need) if need > 0 else []
      if not req.admitted:
        req.admitted, req.admitted_s = True, time.perf_counter()
        req.cached_prompt_tokens = min(req.num_computed, len(req.prompt))
      self.waiting.popleft()
      self.running.append(req)
      out.append(Scheduled(req, n, req.num_computed, samples, d))
      budget -= n
    return prompts_first(out)

  def plan_continue(self, previous: list[Scheduled], K: int):
    """Pipelined speculative decoding: can each request of `previous` (the
    step in flight, whose tokens are not read yet) get one more decode block
    of K + 1 rows, its positions left to the device? Taking nothing: None
    when not now (the engine then reads the step and schedules normally),
    else the plan for `continue_with`; attention-DP ranks check all their
    schedulers before any takes pages. None when requests wait for
    admission, a running request was not in `previous` (or did not sample
    there), K is 0, near the context limit, or when pages or the token
    budget run short (pipelining never preempts); the pages cover the most
    the in-flight step can have accepted."""
    if not K or (self.waiting and len(self.running) < self.max_num_seqs):
      return None
    sampled = {id(s.request) for s in previous if s.samples}
    reqs = [r for r in self.running if not self._will_finish(r)]
    if (not reqs or (K + 1) * len(reqs) > self.budget
        or any(id(r) not in sampled or r.num_computed + 2 * K > self.max_model_len
               for r in reqs)):
      return None
    need = [max(0, self._pages_for(r, K + 1, True, K)) for r in reqs]
    if sum(need) > self.alloc.num_available():
      return None
    return list(zip(reqs, need))

  def continue_with(self, plan, K: int) -> list[Scheduled]:
    """Takes the pages of a `plan_continue` plan -> the pipelined blocks."""
    for r, n in plan:
      r.pages += self.alloc.allocate(n) if n else []
    return [Scheduled(r, K + 1, r.num_computed, True, K, from_state=True) for r, _ in plan]

  def plan_decode(self, scheduled: list[Scheduled], n: int) -> list[int] | None:
    """Multi-step decode (`steps.multi_step`): can `scheduled` (just
    scheduled, not dispatched) run as n decode steps in one program? Taking
    nothing: the pages each chunk needs for its n positions, or None when
    it is not possible now: when requests wait for a free slot, when a
    chunk is not a lone sampling token (a prefill, a draft), when a request
    would pass the context, or when pages run short (multi-step never
    preempts). Attention-DP ranks check all their schedulers before any
    takes pages. Tokens sampled past a request's stop or max_tokens are
    dropped when the step is applied."""
    if (n < 2 or (self.waiting and len(self.running) < self.max_num_seqs)
        or any(s.num_tokens != 1 or not s.samples or s.num_draft or s.from_state
               or s.start + 1 + n > self.max_model_len for s in scheduled)):
      return None
    need = [max(0, self._pages_needed(s.request, n)) for s in scheduled]
    return need if sum(need) <= self.alloc.num_available() else None

  def take_decode(self, scheduled: list[Scheduled], need: list[int], n: int) -> list[Scheduled]:
    """Takes a `plan_decode` plan's pages -> the chunks as n-step decodes."""
    for s, k in zip(scheduled, need):
      s.request.pages += self.alloc.allocate(k) if k else []
    return [dataclasses.replace(s, steps=n) for s in scheduled]

  def on_dispatch(self, scheduled: list[Scheduled]) -> None:
    """The step holding `scheduled` was dispatched to the device."""
    for row, s in enumerate(scheduled):
      req = s.request
      req.num_computed = s.start + s.num_tokens + s.steps - 1
      req.prefill_computed += max(0, min(s.start + s.num_tokens, len(req.prompt)) - s.start)
      if s.samples:
        req.pending += s.steps
        req.pending_row = row
      if s.from_state:
        req.spec_ahead += s.num_tokens

  # ------------------------------------------------------------ results

  def apply(self, scheduled: list[Scheduled], tokens, num_emitted=None,
            num_drafted: int = 0) -> list[tuple[int, list[int], bool]]:
    """Takes a finished step's tokens, every decoder's. Row i: scheduled[i]'s
    token, or the `steps` tokens of a multi-step decode (num_emitted None);
    a speculative step's row i emitted tokens[i, :num_emitted[i]] (its
    accepted drafts, then one token from the target), and num_drafted is
    the drafts it left in the draft state for each sampling row. Steps are
    applied in dispatch order. -> events (request id, new tokens, finished)."""
    now = time.perf_counter()
    events = []
    for i, (s, row) in enumerate(zip(scheduled, token_rows(tokens))):
      req = s.request
      if req.finish_reason is not None:
        continue  # aborted, or stopped on the previous step's token
      if s.from_state:
        req.spec_ahead -= s.num_tokens
      if s.samples:
        req.pending -= s.steps
        n = s.steps
        if num_emitted is not None:
          # The block ends at the last known token (earlier steps are applied),
          # so K/V is valid through it and its accepted drafts; the rejected
          # rest lies past the length and is overwritten. Pipelined blocks
          # still in flight count at their most.
          n = int(num_emitted[i])
          req.num_computed = req.num_known - 1 + n + req.spec_ahead
          req.num_drafts = num_drafted
        events.append((req.id, _append(self, req, row[:n], now), req.finish_reason is not None))
      if req.finish_reason is None:
        self._register_full_pages(req)
    return events

  def _register_full_pages(self, req: Request) -> None:
    """Hashes pages whose tokens are all known and whose K/V is computed."""
    ps = self.alloc.page_size
    full = min(req.num_computed, req.num_known, len(req.pages) * ps) // ps
    if full <= len(req.page_hashes):
      return  # nothing new (most decode steps): skip building the token list
    spans = req.spans
    for k in range(len(req.page_hashes), full):
      parent = req.page_hashes[-1] if req.page_hashes else None
      h = hash_page(parent, req.known(k * ps, (k + 1) * ps),
                    page_extra(spans, k, ps) if spans else b"")
      self.alloc.register(req.pages[k], h)
      req.page_hashes.append(h)

  def finish(self, req: Request, reason: str, now: float | None = None) -> None:
    req.finish_reason = reason
    req.finish_s = now or time.perf_counter()
    if req in self.running:
      self.running.remove(req)
    elif req in self.waiting:
      self.waiting.remove(req)
    if req.pages:
      if reason != "error":  # a failed step's pages may hold anything: never publish them
        self._register_full_pages(req)
      if not (req.hold_pages and reason != "abort"):
        self.alloc.release(req.pages)
        req.pages = []


def _append(sch: Scheduler, req: Request, tokens, now: float) -> list[int]:
  """Appends sampled tokens to a request of `sch` until one stops it; ->
  those appended (a plain function: the host's per-request path each step)."""
  new, out = [], req.output
  for token in tokens:
    token = int(token)
    out.append(token)
    new.append(token)
    if req.first_token_s is None:
      req.first_token_s = now
    if token in req.stop_ids:
      sch.finish(req, "stop", now)
    elif len(out) >= req.sampling.max_tokens or len(req.prompt) + len(out) >= sch.max_model_len:
      sch.finish(req, "length", now)
    if req.finish_reason is not None:
      break
  return new


def token_rows(sampled) -> list[list[int]]:
  """A step's samples (row i: a token, or a multi-step decode's tokens; an
  array or a list) -> each row's tokens as a list of Python ints, converted
  in one call where the rows are even."""
  try:
    return np.asarray(sampled).reshape(len(sampled), -1).tolist()
  except ValueError:  # uneven rows, or none
    return [np.atleast_1d(t).tolist() for t in sampled]


def schedule_ranks(schedulers: list[Scheduler], ks, config) -> list[list[Scheduled]]:
  """Every rank's chunks for the next step (ks: each rank's draft budget K;
  config: the `EngineConfig`). Under attention DP with
  `EngineConfig.dp_balance="split"` the ranks share one token budget: the
  upper median of what they want (`Scheduler.demand`), at least their
  largest decode demand and dp_min_step_tokens. So a lone prefill is split
  into chunks the size of the others' steps, and steps where most ranks
  prefill keep the full budget."""
  return [s.schedule(k, b) for s, k, b in zip(schedulers, ks, _rank_budgets(schedulers, ks, config))]


def _rank_budgets(schedulers, ks, c) -> list:
  if len(schedulers) == 1 or c.dp_balance == "none" or c.fixed_step_shapes:
    return [None] * len(schedulers)
  demands = [s.demand(k) for s, k in zip(schedulers, ks)]
  wants = sorted(d + p for d, p in demands)
  target = max(wants[len(wants) // 2], max(d for d, _ in demands), c.dp_min_step_tokens)
  return [bucket(target, c.max_num_batched_tokens)] * len(schedulers)
