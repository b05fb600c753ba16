"""`EngineLoop`: one thread owns an `Engine` or a `Cluster` and steps it
while it has work; asyncio code hands it requests through a thread-safe
queue and reads each request's tokens from its own asyncio queue.

  loop = EngineLoop(engine, max_queue=64); loop.start()
  stream = loop.submit(prompt_ids, sampling)       # on the event loop
  kind, payload = await stream.get()               # ("accepted", None), then ("tokens", Tokens)...
                                                   # and ("done", Result) or ("error", ApiError)
  loop.abort(stream, reason="abort")               # e.g. the client went away

Nothing but the loop's thread touches the backend. A request ends with
exactly one "done" (a `Result`) or "error" (an `ApiError`); `submit` refuses
at once (429) when `max_queue` requests are already held, and so does a
Cluster whose own queue is full.

A step that raises is logged with its traceback; a backend with `recover`
(an `Engine`) then ends the requests it held with finish_reason "error" and
the reason, and goes on serving (`health` says "degraded" for
DEGRADED_WINDOW_S after). The engine is "dead" (every request a 503) when
recovery fails, when MAX_CONSECUTIVE_FAILURES steps fail in a row, or when
the backend cannot recover (a Cluster).

`warm_in_background(programs)` (an `Engine`'s `warmup.programs`) compiles
those step programs on the loop's thread while no request is unfinished,
one between checks of the queue, so a server takes requests from its start
(a request's own programs compile when it needs them) and a request waits
for at most the one program being compiled; `health` says "warming" until
the list is done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from jaxinfer.serving.flow import Flow, QueueFull
from jaxinfer.serving.openai_protocol import ApiError

log = logging.getLogger("jaxinfer.serving")

MAX_CONSECUTIVE_FAILURES = 3
DEGRADED_WINDOW_S = 300.0
# A gather (EngineLoop's gather_s) ends at most this many windows after it
# began, however steadily requests keep coming.
GATHER_MAX_WINDOWS = 4


@dataclasses.dataclass(frozen=True)
class Result:
  """How a request ended, in the backend's terms (an `Engine`'s
  `RequestOutput`, a Cluster's `ServeOutput`), and its time in the server."""
  token_ids: list[int]
  prompt_tokens: int
  finish_reason: str  # "stop" | "length" | "abort" | "error"
  error: str | None
  ttft_s: float | None
  tpot_s: float | None
  queue_s: float | None = None  # submitted -> first scheduled (an Engine)
  cached_prompt_tokens: int = 0
  logprobs: list | None = None  # `TokenLogprobs` per token (sampling.logprobs set)
  prompt_logprobs: list | None = None  # per prompt token, the first None
  e2e_s: float | None = None  # handed to the engine thread -> ended


@dataclasses.dataclass(frozen=True)
class Tokens:
  """New tokens of a request, with their `TokenLogprobs` when it asked;
  its first also brings the prompt's logprobs when it asked for those."""
  ids: list[int]
  logprobs: list | None = None
  prompt_logprobs: list | None = None


class Stream:
  """One request's channel from the engine thread to its handler."""

  def __init__(self, loop: asyncio.AbstractEventLoop, sampling=None):
    self._loop, self._queue = loop, asyncio.Queue()
    self.t0 = time.monotonic()
    self.logprobs = sampling is not None and (getattr(sampling, "logprobs", None) is not None or
                                              getattr(sampling, "prompt_logprobs", None) is not None)
    self.rid: int | None = None
    self.first_token = False
    self.closed = False  # "done" / "error" delivered, or aborted

  def post(self, item) -> None:  # engine thread
    try:
      self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
    except RuntimeError:  # the event loop is closed: nobody is listening
      pass

  async def get(self):
    return await self._queue.get()


def _engines(backend):
  return [w.engine for w in backend.workers if w.alive] if isinstance(backend, Flow) else [backend]


def result_of(backend, rid: int) -> Result:
  out = backend.output(rid)
  m = getattr(out, "metrics", out)  # Engine: RequestOutput.metrics; Cluster: ServeOutput
  return Result(token_ids=list(out.token_ids), prompt_tokens=len(out.prompt_token_ids),
                finish_reason=out.finish_reason, error=getattr(out, "error", None),
                ttft_s=m.ttft_s, tpot_s=m.tpot_s, queue_s=getattr(m, "queue_s", None),
                cached_prompt_tokens=m.cached_prompt_tokens,
                logprobs=getattr(out, "logprobs", None),
                prompt_logprobs=getattr(out, "prompt_logprobs", None))


class EngineLoop:
  """See the module docstring. on_finish(result): called on the engine
  thread when a request ends (metrics). gather_s: when a request wakes an
  idle backend, the requests that follow it, each within gather_s of the
  one before (for at most GATHER_MAX_WINDOWS * gather_s), join its first
  step: a burst prefills in one step instead of its first request in a step
  of its own while the others wait for it. 0: step at once. gather_tokens:
  the gather also ends once the burst's prompts hold this many tokens (a
  step's worth: later arrivals would wait for the next step anyway, and the
  burst's first step goes now); None: no limit."""

  def __init__(self, backend, *, max_queue: int, on_finish=None, gather_s: float = 0.0,
               gather_tokens: int | None = None):
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if not gather_s >= 0:
      raise ValueError(f"gather_s must be >= 0, got {gather_s}")
    self.backend, self.max_queue, self.on_finish = backend, max_queue, on_finish
    if gather_tokens is not None and gather_tokens < 1:
      raise ValueError(f"gather_tokens must be >= 1 or None, got {gather_tokens}")
    self.gather_s, self.gather_tokens = gather_s, gather_tokens
    self._burst_tokens = 0  # prompt tokens submitted since the backend was last idle
    self.max_model_len = min(e.max_model_len for e in _engines(backend))
    self.vocab_size = min(e.vocab_size for e in _engines(backend))
    self._inbox: queue.Queue = queue.Queue()
    self._live: dict[int, Stream] = {}  # backend rid -> stream (engine thread only)
    self._held = 0  # requests accepted and not yet ended
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="engine-loop")
    self.error: BaseException | None = None  # the engine is dead
    self.step_failures = 0
    self._failed_in_a_row = 0
    self._last_failure: tuple[float, str] | None = None  # (monotonic time, error)
    self._warm: list = []  # step programs left to compile while idle (engine thread)
    # The background warm-up's progress (left_out: programs it left to traffic).
    self.warm = dict(compiled=0, left=0, seconds=0.0, left_out=0)

  # ------------------------------------------------------------ event loop side

  def start(self) -> None:
    self._thread.start()

  def warm_in_background(self, programs: list) -> None:
    """Compiles `programs` (`Engine.warmup`'s) while the backend is idle; call
    before `start`."""
    if self._thread.is_alive():
      raise RuntimeError("warm_in_background: call it before start()")
    self._warm = list(programs)
    self.warm.update(left=len(self._warm))

  def stop(self) -> None:
    self._stop.set()
    self._inbox.put(None)
    self._thread.join()

  def submit(self, prompt: list[int], sampling, images=None) -> Stream:
    """Queues a request for the engine thread; ApiError 429 when full, 503
    when the engine thread has failed. images: the prompt's images (an
    `Engine` with a vision model), or None."""
    if self.error is not None:
      raise ApiError(503, f"the engine failed: {self.error!r}", kind="server_error")
    with self._lock:
      if self._held >= self.max_queue:
        raise ApiError(429, f"the server holds {self._held} requests (max_queue="
                       f"{self.max_queue}); retry later", code="queue_full",
                       kind="rate_limit_exceeded")
      self._held += 1
    stream = Stream(asyncio.get_running_loop(), sampling)
    self._inbox.put(("submit", stream, prompt, sampling, images))
    return stream

  def abort(self, stream: Stream, reason: str = "abort") -> None:
    """Stops a request and frees its pages; reason is what metrics count."""
    if not stream.closed:
      self._inbox.put(("abort", stream, reason))

  def health(self) -> dict:
    """{"status": "ok" | "warming" | "degraded" | "dead", "step_failures": n,
    and when one happened "last_error" and "last_failure_s_ago"; while
    warming (`warm_in_background`), "warm_up": programs compiled and left}."""
    out = dict(status="ok", step_failures=self.step_failures)
    if self.warm["left"]:
      out.update(status="warming", warm_up=dict(self.warm))
    if self._last_failure is not None:
      at, why = self._last_failure
      out.update(last_error=why, last_failure_s_ago=round(time.monotonic() - at, 3))
      if time.monotonic() - at < DEGRADED_WINDOW_S:
        out["status"] = "degraded"
    if self.error is not None:
      out.update(status="dead", error=repr(self.error))
    return out

  async def stats(self) -> dict:
    """A snapshot of the backend's counters, taken on the engine thread."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    def reply(snapshot):  # engine thread
      loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(snapshot))
    self._inbox.put(("stats", reply))
    return await asyncio.wait_for(fut, timeout=30)

  # ------------------------------------------------------------ engine thread

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        busy = self.backend.has_unfinished()
        if not busy:
          self._burst_tokens = 0
        self._drain(block=not busy and not self._warm)
        if not busy and self.gather_s and self.backend.has_unfinished():
          self._gather()
        if self.backend.has_unfinished():
          self._step()
        elif self._warm:
          self._warm_one()
    except BaseException as e:  # noqa: BLE001 - every held request is told
      log.critical("the engine loop failed; every request now gets a 503", exc_info=e)
      self.error = e
      for stream in list(self._live.values()):
        self._end(stream, error=ApiError(500, f"the engine failed: {e!r}", kind="server_error"))
      while not self._stop.is_set():  # from now on every request gets a 503, never silence
        self._drain(block=True)

  def _warm_one(self) -> None:
    """Compiles the next background warm-up program (a failure is logged
    and the rest dropped: requests still compile what they need)."""
    program = self._warm.pop(0)
    try:
      report = self.backend.warmup(programs=[program])
    except Exception as e:  # noqa: BLE001 - serving goes on without the warm-up
      log.error("the background warm-up failed; %d programs left to compile on first use",
                len(self._warm), exc_info=e)
      self._warm = []
    else:
      self.warm["compiled"] += report["programs"]
      self.warm["seconds"] += report["seconds"]
      if report["left_out"]:  # the memory-map share is used: the rest on first use
        self.warm["left_out"] = len(self._warm) + report["left_out"]
        log.warning("the background warm-up stopped at its share of vm.max_map_count memory "
                    "maps; %d programs left to compile on first use", self.warm["left_out"])
        self._warm = []
    self.warm["left"] = len(self._warm)

  def _step(self) -> None:
    try:
      events = self.backend.step()
    except Exception as e:  # noqa: BLE001 - its requests fail, the others go on
      self._step_failed(e)
      return
    self._failed_in_a_row = 0
    self._dispatch(events)

  def _step_failed(self, e: Exception) -> None:
    """Ends the failed step's requests with the reason; raises (the engine
    is dead) when the backend cannot recover."""
    why = f"the engine step failed: {type(e).__name__}: {e}"
    self.step_failures += 1
    self._failed_in_a_row += 1
    self._last_failure = (time.monotonic(), why)
    log.error("%s (requests held: %d; failure %d in a row)", why, len(self._live),
              self._failed_in_a_row, exc_info=e)
    recover = getattr(self.backend, "recover", None)
    if recover is None or self._failed_in_a_row >= MAX_CONSECUTIVE_FAILURES:
      raise RuntimeError(f"{why} ({self._failed_in_a_row} in a row; no recovery)") from e
    recover()
    for rid, stream in list(self._live.items()):  # every request it held ended
      result = result_of(self.backend, rid)
      self._end(stream, result=dataclasses.replace(result, finish_reason="error", error=why))

  def _drain(self, block: bool) -> None:
    while True:
      try:
        cmd = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
      except queue.Empty:
        return
      block = False
      if cmd is not None:
        self._command(*cmd)

  def _gather(self) -> None:
    """Handles commands while each arrives within gather_s of the one
    before, for at most GATHER_MAX_WINDOWS * gather_s from now, until the
    burst's prompts hold gather_tokens."""
    now = time.monotonic()
    cap = now + GATHER_MAX_WINDOWS * self.gather_s
    full = self.gather_tokens or float("inf")
    while (self._burst_tokens < full
           and (left := min(now + self.gather_s, cap) - time.monotonic()) > 0):
      try:
        cmd = self._inbox.get(timeout=left)
      except queue.Empty:
        return
      now = time.monotonic()
      if cmd is not None:
        self._command(*cmd)

  def _command(self, kind, *args) -> None:
    if kind == "submit":
      stream, prompt, sampling, images = args
      if self.error is not None:
        return self._end(stream, error=ApiError(503, f"the engine failed: {self.error!r}",
                                                kind="server_error"))
      try:
        extra = {} if images is None else dict(images=images)
        stream.rid = self.backend.submit(prompt, sampling, **extra)
      except QueueFull as e:
        return self._end(stream, error=ApiError(429, str(e), code="queue_full",
                                                kind="rate_limit_exceeded"))
      except (ValueError, TypeError) as e:
        return self._end(stream, error=ApiError(400, str(e)))
      self._live[stream.rid] = stream
      self._burst_tokens += len(prompt)
      stream.post(("accepted", None))
    elif kind == "abort":
      stream, reason = args
      if stream.rid in self._live and not stream.closed:
        self.backend.abort(stream.rid)
        self._end(stream, result=dataclasses.replace(result_of(self.backend, stream.rid),
                                                     finish_reason=reason))
    elif kind == "stats":
      try:
        args[0](self._snapshot())
      except Exception as e:  # noqa: BLE001 - a failed engine still answers
        args[0](dict(error=repr(e)))

  def _dispatch(self, events) -> None:
    for rid, new, finished in events:
      stream = self._live.get(rid)
      if stream is None:
        continue
      if new:
        stream.post(("tokens", self._tokens(stream, rid, new)))
        stream.first_token = True
      if finished:
        self._end(stream, result=result_of(self.backend, rid))

  def _tokens(self, stream: Stream, rid: int, new) -> Tokens:
    ids = [int(t) for t in new]
    if not stream.logprobs:
      return Tokens(ids)
    lps, prompt_lps = self.backend.logprobs_tail(rid, len(ids))
    return Tokens(ids, lps, None if stream.first_token else prompt_lps)

  def _end(self, stream: Stream, *, result: Result | None = None,
           error: ApiError | None = None) -> None:
    if result is not None:
      result = dataclasses.replace(result, e2e_s=time.monotonic() - stream.t0)
    stream.closed = True
    self._live.pop(stream.rid, None)
    with self._lock:
      self._held -= 1
    if result is not None and self.on_finish is not None:
      self.on_finish(result)
    stream.post(("done", result) if error is None else ("error", error))

  def _snapshot(self) -> dict:
    engines = [e.stats() for e in _engines(self.backend)]
    total = lambda key: sum(s.get(key, 0) for s in engines)
    spec = [s["spec_mean_accepted_length"] for s in engines if "spec_mean_accepted_length" in s]
    with self._lock:
      held = self._held
    return dict(held=held, waiting=held - sum(s.first_token for s in self._live.values()),
                running=total("running"), kv_pages_used=total("kv_pages_used"),
                kv_pages_free=total("kv_pages_free"), kv_pages_total=total("kv_pages_total"),
                kv_pages_cached=total("kv_pages_cached"), preemptions=total("preemptions"),
                prompt_tokens=total("prompt_tokens"),
                cached_prompt_tokens=total("cached_prompt_tokens"), compiles=total("compiles"),
                spec_mean_accepted_length=sum(spec) / len(spec) if spec else None)
