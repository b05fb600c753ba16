"""With async scheduling, nothing is dispatched behind a prompt step until it
is read (`steps.Runner.dispatch`): prompts that arrive while it runs
join the next step whole, beside the running sequences' decodes, instead of
a step being committed with half of them."""

import dataclasses

import jax

from conftest import assert_no_leak, random_prompts
from jaxinfer import Engine, EngineConfig, SamplingParams, engine, models, presets


def _prompt_chunks(eng) -> list[int]:
  """The number of prompt chunks (more than one token) of each step in flight."""
  return [sum(s.num_tokens > 1 for sch in d.per_rank for s in sch)
          for d in eng._runner.in_flight]


def test_prompts_arriving_during_a_prompt_step_share_the_next_one():
  cfg = dataclasses.replace(presets.get("tiny_dense"), dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  prompts = random_prompts(cfg, [12, 9, 14, 11, 10, 13], seed=5)
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, max_num_batched_tokens=64,
                                         async_scheduling=True))
  sp = SamplingParams(max_tokens=6)
  ids = [eng.submit(p, sp) for p in prompts[:2]]
  assert eng.step() == [] and _prompt_chunks(eng) == [2]  # the first prompt step, in flight
  ids += [eng.submit(prompts[2], sp)]
  events = eng.step()  # behind a prompt step: reads it, dispatches nothing
  assert sorted(r for r, _, _ in events) == ids[:2] and _prompt_chunks(eng) == []
  ids += [eng.submit(p, sp) for p in prompts[3:]]  # more arrive before the next step
  eng.step()
  # One step: the four new prompts whole and the first two's decodes.
  (step,) = eng._runner.in_flight
  assert [s.num_tokens for sch in step.per_rank for s in sch] == [14, 11, 10, 13, 1, 1]
  while eng.has_unfinished():
    eng.step()
  got = [eng.output(i).token_ids for i in ids]
  assert got == engine.greedy_reference(cfg, params, prompts, 6)
  assert_no_leak(eng)


def test_decode_steps_stay_pipelined():
  cfg = dataclasses.replace(presets.get("tiny_dense"), dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  eng = Engine(cfg, params, EngineConfig(page_size=8, num_pages=64, async_scheduling=True))
  rid = eng.submit(random_prompts(cfg, [7], seed=6)[0], SamplingParams(max_tokens=8))
  eng.step()  # the prompt step
  eng.step()  # read behind it
  eng.step()  # a decode step in flight, then the next dispatched behind it
  eng.step()
  assert len(eng._runner.in_flight) == 1 and _prompt_chunks(eng) == [0]
