"""The scheduler's admission of waiting prompts: a prompt that fits whole in
a later step is not split beside another prompt (its rest would continue
past position 0 in a step of its own or among the next step's fresh
prompts); longer prompts, and a prompt alone beside decodes, are chunked.
A step lists its prompt chunks before its decodes (the packed attention's
blocks then start at a prompt's first token)."""

from jaxinfer import SamplingParams
from jaxinfer.engine.scheduler import Request, Scheduler
from jaxinfer.kv.allocator import PageAllocator


def _scheduler(budget=40, chunk=40):
  return Scheduler(PageAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=budget,
                   prefill_chunk_size=chunk, max_model_len=256)


def _add(sch, rid, n):
  req = Request(id=rid, prompt=list(range(1000 * rid + 1, 1000 * rid + n + 1)), sampling=SamplingParams(max_tokens=50),
                stop_ids=frozenset())
  sch.add(req)
  return req


def _run(sch):
  """One step: scheduled, dispatched, each sampling chunk given a token ->
  [(request id, tokens, start)]."""
  out = sch.schedule()
  sch.on_dispatch(out)
  sch.apply(out, [7 if s.samples else -1 for s in out])
  return [(s.request.id, s.num_tokens, s.start) for s in out]


def test_a_prompt_that_fits_a_later_step_waits_whole():
  sch = _scheduler()
  _add(sch, 0, 20)
  _add(sch, 1, 30)
  assert _run(sch) == [(0, 20, 0)]  # 1 would split 20 + 10: it waits
  assert _run(sch) == [(1, 30, 0), (0, 1, 20)]  # the prompt first, then the decode
  assert sch.alloc.num_available() == 63 - 6 - 8  # 21 + 30 tokens in pages of 4


def test_long_prompts_and_lone_prompts_are_chunked():
  sch = _scheduler(budget=40, chunk=32)
  _add(sch, 0, 20)
  _add(sch, 1, 50)  # longer than a chunk: split wherever it lands
  assert _run(sch) == [(0, 20, 0), (1, 20, 0)]
  assert _run(sch) == [(1, 30, 20), (0, 1, 20)]
  sch = _scheduler()
  for rid in range(3):
    _add(sch, rid, 2)
  _run(sch)
  _add(sch, 3, 39)  # beside 3 decodes, alone: 37 now, 2 next step
  assert _run(sch) == [(3, 37, 0), (0, 1, 2), (1, 1, 2), (2, 1, 2)]
  assert _run(sch)[0] == (3, 2, 37)
