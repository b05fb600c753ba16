"""`EngineLoop` on a stand-in backend: with gather_s, the requests of a
burst that wakes an idle backend join its first step; without, the first
request steps alone. And a negative gather_s is refused."""

import asyncio
import types

import pytest

from jaxinfer.serving.engine_loop import EngineLoop


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


async def _burst(loop: EngineLoop, gap_s: float):
  streams = []
  for _ in range(3):
    streams.append(loop.submit([1], None))
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


def test_negative_gather_is_refused():
  with pytest.raises(ValueError, match="gather_s must be >= 0"):
    EngineLoop(_Backend(), max_queue=8, gather_s=-1.0)
