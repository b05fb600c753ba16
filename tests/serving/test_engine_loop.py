"""`EngineLoop` on a stand-in backend: with gather_s, the requests of a
burst that wakes an idle backend join its first step, each within gather_s
of the one before, up to GATHER_MAX_WINDOWS windows or until the burst's
prompts hold gather_tokens; without, the first request steps alone. And a
negative gather_s or a gather_tokens under 1 is refused."""

import asyncio
import time
import types

import pytest

from jaxinfer.serving.engine_loop import GATHER_MAX_WINDOWS, EngineLoop


class _Backend:
  """Finishes every held request in one step; records each step's batch."""
  max_model_len, vocab_size = 64, 256

  def __init__(self):
    self.held, self.batches, self.next_rid = [], [], 0

  def has_unfinished(self):
    return bool(self.held)

  def submit(self, prompt, sampling):
    self.next_rid += 1
    self.held.append(self.next_rid)
    return self.next_rid

  def step(self):
    self.batches.append(len(self.held))
    done, self.held = self.held, []
    return [(rid, [7], True) for rid in done]

  def output(self, rid):
    metrics = types.SimpleNamespace(ttft_s=0.0, tpot_s=0.0, queue_s=0.0, cached_prompt_tokens=0)
    return types.SimpleNamespace(token_ids=[7], prompt_token_ids=[1], finish_reason="length",
                                 metrics=metrics)


async def _burst(loop: EngineLoop, gap_s: float, n: int = 3, prompt_len: int = 1):
  streams = []
  for _ in range(n):
    streams.append(loop.submit([1] * prompt_len, None))
    await asyncio.sleep(gap_s)
  for s in streams:
    while (await s.get())[0] != "done":
      pass


@pytest.mark.parametrize("gather_s,first_batch", [(0.0, 1), (1.0, 3)])
def test_a_burst_waking_an_idle_backend_joins_one_step_with_gather(gather_s, first_batch):
  backend = _Backend()
  loop = EngineLoop(backend, max_queue=8, gather_s=gather_s)
  loop.start()
  try:
    asyncio.run(_burst(loop, gap_s=0.15))
  finally:
    loop.stop()
  assert backend.batches[0] == first_batch
  assert sum(backend.batches) == 3  # every request stepped, none dropped


def _first_batch(gather_s: float, gap_s: float, n: int, prompt_len: int = 1,
                 gather_tokens: int | None = None) -> int:
  backend = _Backend()
  loop = EngineLoop(backend, max_queue=16, gather_s=gather_s, gather_tokens=gather_tokens)
  loop.start()
  try:
    asyncio.run(_burst(loop, gap_s=gap_s, n=n, prompt_len=prompt_len))
  finally:
    loop.stop()
  assert sum(backend.batches) == n  # every request stepped, none dropped
  return backend.batches[0]


def test_the_gather_window_slides_with_each_arrival():
  # 3 requests 0.2 s apart span 0.4 s: a fixed 0.3 s window would take 2.
  assert _first_batch(gather_s=0.3, gap_s=0.2, n=3) == 3


def test_the_gather_ends_after_its_most_windows():
  # Arrivals 0.12 s apart never leave a 0.2 s window open: the gather stops
  # at GATHER_MAX_WINDOWS windows (0.8 s), with about 7 of the 12.
  first = _first_batch(gather_s=0.2, gap_s=0.12, n=12)
  assert 2 <= first < 12
  assert first <= GATHER_MAX_WINDOWS * 0.2 / 0.12 + 2


@pytest.mark.parametrize("gather_tokens,first", [(None, 6), (40, 4), (41, 5)])
def test_the_gather_ends_once_the_burst_fills_a_step(gather_tokens, first):
  # 6 prompts of 10 tokens 0.1 s apart, a 1 s window: all 6 without a token
  # limit; with 40 the fourth fills the step, and it goes without the rest.
  assert _first_batch(gather_s=1.0, gap_s=0.1, n=6, prompt_len=10,
                      gather_tokens=gather_tokens) == first


def test_negative_gather_is_refused():
  with pytest.raises(ValueError, match="gather_s must be >= 0"):
    EngineLoop(_Backend(), max_queue=8, gather_s=-1.0)
  with pytest.raises(ValueError, match="gather_tokens must be >= 1"):
    EngineLoop(_Backend(), max_queue=8, gather_s=0.1, gather_tokens=0)


class _WarmingBackend(_Backend):
  """A backend whose `warmup(programs=[p])` takes 20 ms a program; records
  the order of compiles and steps."""

  def __init__(self):
    super().__init__()
    self.log = []

  def warmup(self, programs):
    assert not self.held, "warm-up while a request is unfinished"
    time.sleep(0.02)
    self.log += [("compile", p) for p in programs]
    return dict(programs=len(programs), left_out=0, seconds=0.02)

  def step(self):
    self.log.append(("step", len(self.held)))
    return super().step()


def test_a_background_warm_up_yields_to_requests_and_health_says_warming_until_done():
  backend = _WarmingBackend()
  loop = EngineLoop(backend, max_queue=8)
  loop.warm_in_background(list(range(40)))
  assert loop.health()["status"] == "warming"

  async def serve_one():
    while not any(kind == "compile" for kind, _ in backend.log):
      await asyncio.sleep(0.005)
    health = loop.health()  # warming, with its progress
    s = loop.submit([1], None)
    while (await s.get())[0] != "done":
      pass
    return health

  loop.start()
  try:
    with pytest.raises(RuntimeError, match="before start"):
      loop.warm_in_background([1])
    health = asyncio.run(serve_one())
    deadline = time.monotonic() + 10
    while loop.health()["status"] == "warming" and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    loop.stop()
  assert health["status"] == "warming" and health["warm_up"]["left"] < 40
  assert loop.health()["status"] == "ok" and "warm_up" not in loop.health()
  assert loop.warm["compiled"] == 40 and loop.warm["left"] == 0
  compiles = [p for kind, p in backend.log if kind == "compile"]
  assert compiles == list(range(40))  # every program once, in the list's order
  step_at = backend.log.index(("step", 1))
  assert 0 < step_at < len(backend.log) - 1  # served between two compiles, not after all 40
