"""Multi-step decode (`EngineConfig.decode_steps`): several decode steps in
one program give exactly the tokens of one step per dispatch (greedy against
repeated full forwards, seeded sampling against the single-step engine),
stop on time, never leak pages, and fall back to single steps where they
cannot run (prefill, the context limit, short pages)."""

import dataclasses

import numpy as np
import pytest

from conftest import assert_no_leak as _no_leak, float32_model as _model, random_prompts as _prompts
from jaxinfer import Engine, EngineConfig, MTPConfig, SamplingParams, engine, sharding
from jaxinfer.engine.steps import multi_step
from jaxinfer.engine.scheduler import Request, Scheduler
from jaxinfer.kv.allocator import PageAllocator


@pytest.mark.parametrize("name,async_scheduling,fixed", [
    ("tiny_dense", True, False), ("tiny_dense", False, False), ("tiny_moe", True, False),
    ("tiny_dense", True, True)])
def test_greedy_matches_repeated_full_forward_in_fewer_dispatches(name, async_scheduling, fixed):
  cfg, params = _model(name)
  prompts = _prompts(cfg, [3, 17, 9, 30])
  # fixed: every step padded to the token budget (padding rows stay put).
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=128, decode_steps=4,
                                         async_scheduling=async_scheduling,
                                         fixed_step_shapes=fixed, max_num_batched_tokens=64))
  outs = eng.generate(prompts, SamplingParams(max_tokens=11))  # 1 + 10: not a multiple of 4
  assert [o.token_ids for o in outs] == engine.greedy_reference(cfg, params, prompts, 11)
  assert all(o.finish_reason == "length" for o in outs)
  # One prefill step, then blocks of 4 (the last one's extra tokens dropped).
  assert eng.stats()["steps"] == 1 + 3
  _no_leak(eng)


@pytest.mark.parametrize("name,layout,axes", [
    ("tiny_moe", "dp_attn_ep", {"data": 4, "expert": 2}),  # every DP rank in one program
    ("tiny_dense", "tp", {"data": 4, "tensor": 2}),
])
def test_on_a_mesh_matches_repeated_full_forward(name, layout, axes):
  cfg, params = _model(name)
  prompts = _prompts(cfg, [3, 17, 9, 30, 5], seed=6)
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, decode_steps=4),
               mesh=sharding.make_mesh(axes), layout=layout)
  outs = eng.generate(prompts, SamplingParams(max_tokens=11))
  assert [o.token_ids for o in outs] == engine.greedy_reference(cfg, params, prompts, 11)
  assert eng.stats()["steps"] <= 5  # single steps take 11 or more
  _no_leak(eng)


def test_stop_token_inside_a_block_ends_the_request_there():
  cfg, params = _model("tiny_dense")
  prompt = _prompts(cfg, [12], seed=3)[0]
  greedy = engine.greedy_reference(cfg, params, [prompt], 10)[0]
  stop = greedy[6]
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, decode_steps=4))
  rid = eng.submit(prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
  streamed, events = [], 0
  while eng.has_unfinished():
    for r, new, fin in eng.step():
      streamed += new
      events += 1
  out = eng.output(rid)
  assert out.finish_reason == "stop"
  assert streamed == out.token_ids == greedy[:greedy.index(stop) + 1]
  assert events < len(streamed)  # tokens arrived in blocks
  _no_leak(eng)


def test_seeded_sampling_draws_what_single_steps_draw():
  cfg, params = _model("tiny_moe")
  prompts = _prompts(cfg, [5, 20, 8], seed=4)
  sampling = [SamplingParams(max_tokens=9, temperature=0.9, top_k=7, seed=11),
              SamplingParams(max_tokens=12, temperature=1.3, top_p=0.8, seed=12),
              SamplingParams(max_tokens=6, temperature=0.0)]
  outs = {}
  for n in (1, 3):
    eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=128, decode_steps=n))
    ids = [eng.submit(p, s) for p, s in zip(prompts, sampling)]
    while eng.has_unfinished():
      eng.step()
    outs[n] = [eng.output(i).token_ids for i in ids]
    _no_leak(eng)
  assert outs[3] == outs[1]
  assert [len(t) for t in outs[3]] == [9, 12, 6]


def test_expert_load_counts_each_step_of_a_block():
  cfg, params = _model("tiny_moe")
  prompts = _prompts(cfg, [7, 13], seed=5)
  loads = {}
  for n in (1, 4):
    eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, decode_steps=n))
    eng.generate(prompts, SamplingParams(max_tokens=9))  # 1 + 8: two whole blocks of 4
    loads[n] = eng.expert_load()
  np.testing.assert_array_equal(loads[4], loads[1])
  assert loads[4].sum() > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_context_limit_waiting_requests_and_preemption_match(async_scheduling):
  cfg, params = _model("tiny_dense")
  # The context limit falls inside a block: the last tokens come one step at a time.
  eng = Engine(cfg, params, EngineConfig(page_size=4, num_pages=64, max_model_len=22,
                                         decode_steps=4, async_scheduling=async_scheduling))
  prompt = _prompts(cfg, [15], seed=9)[0]
  out = eng.generate([prompt], SamplingParams(max_tokens=50))[0]
  assert out.finish_reason == "length" and len(out.token_ids) == 7
  assert out.token_ids == engine.greedy_reference(cfg, params, [prompt], 7)[0]
  # Two slots for five requests in a small pool: admissions wait for blocks
  # to end, and the pool forces preemption.
  prompts = _prompts(cfg, [30, 35, 41, 27, 9], seed=1)
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=15, max_num_seqs=3,
                                         max_num_batched_tokens=64, decode_steps=4,
                                         async_scheduling=async_scheduling))
  outs = eng.generate(prompts, SamplingParams(max_tokens=24))
  assert eng.stats()["preemptions"] > 0
  assert [o.token_ids for o in outs] == engine.greedy_reference(cfg, params, prompts, 24)
  _no_leak(eng)


def _extend(sch, scheduled, n):
  out = multi_step([sch], [scheduled], n)
  return None if out is None else out[0]


def test_multi_step_takes_pages_for_every_position_or_nothing():
  alloc = PageAllocator(8, 4)  # 7 usable pages of 4 tokens
  sch = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64,
                  max_model_len=40)
  req = Request(id=0, prompt=list(range(10)), sampling=SamplingParams(max_tokens=99),
                stop_ids=frozenset())
  sch.add(req)
  (s,) = sch.schedule()  # the prefill
  sch.on_dispatch([s])
  sch.apply([s], [1])
  (s,) = sch.schedule()  # the decode of token 10 at position 10
  assert (s.num_tokens, s.start, len(req.pages), alloc.num_available()) == (1, 10, 3, 4)
  (m,) = _extend(sch, [s], 6)  # positions 10..15: one more page
  assert m.steps == 6 and len(req.pages) == 4 and alloc.num_available() == 3
  sch.on_dispatch([m])
  assert req.pending == 6 and req.num_computed == 16 and req.total_len == 17
  events = sch.apply([m], [np.arange(20, 26)])
  assert events == [(0, list(range(20, 26)), False)] and req.pending == 0
  (s,) = sch.schedule()  # position 16: a fifth page, two left
  assert alloc.num_available() == 2
  assert _extend(sch, [dataclasses.replace(s, num_tokens=2)], 4) is None  # not a decode
  assert _extend(sch, [s], 24) is None  # 16 + 1 + 24 tokens pass the context of 40
  assert _extend(sch, [s], 16) is None  # positions to 31 need 3 more pages
  assert _extend(sch, [s], 1) is None
  assert alloc.num_available() == 2  # nothing taken
  assert _extend(sch, [s], 12)[0].steps == 12 and alloc.num_available() == 0


def test_bad_decode_steps_raise():
  with pytest.raises(ValueError, match="decode_steps must be >= 1"):
    EngineConfig(decode_steps=0)
  with pytest.raises(TypeError, match="decode_steps must be an int"):
    EngineConfig(decode_steps=2.5)
  with pytest.raises(TypeError, match="decode_steps must be an int"):
    EngineConfig(decode_steps="4")
  with pytest.raises(ValueError, match="decode_steps > 1 is for plain decoding"):
    EngineConfig(decode_steps=2, speculative=MTPConfig(num_draft_tokens=2))
