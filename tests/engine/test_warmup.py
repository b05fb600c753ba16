"""`Engine.warmup`: after it, plain traffic with new prompt lengths,
concurrency up to past max_num_seqs, greedy and sampled, compiles nothing
(the engine's own program count), and the tokens are those of an engine
that never warmed up."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import Backend, Engine, EngineConfig, MTPConfig, SamplingParams, models, presets
from jaxinfer.engine import warmup

CONFIG = dict(page_size=8, num_pages=64, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=24)


def _model(**kw):
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32", **kw)
  return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("library", [False, True])
def test_after_warmup_plain_traffic_compiles_nothing(library):
  # With library attention, prompt steps of fresh chunks are programs of their own.
  cfg, params = _model(**(dict(backend=Backend(dense_attention="jax_nn")) if library else {}))
  eng = Engine(cfg, params, EngineConfig(**CONFIG, fixed_prefill_shapes=True, decode_steps=2))
  report = eng.warmup()
  assert report["programs"] == len(warmup.programs(eng)) == eng.stats()["compiles"]
  # Prompt steps: every sequence, the budget or a smaller power of two of tokens.
  assert {(s.tokens, s.seqs) for s, *_ in warmup.programs(eng) if s.max_q > 1} == {(16, 2), (32, 2)}  # 32 // 4 -> 16 at least
  assert any(s.fresh for s, *_ in warmup.programs(eng)) == library
  assert eng.stats()["steps"] == 0  # the warm-up's padding steps are not counted as traffic
  rng = np.random.default_rng(0)
  prompts, sampling = [], []
  for concurrency in (1, 2, 3, 2, 1):  # past max_num_seqs: some wait for a slot
    batch = [rng.integers(0, 256, rng.integers(1, 17)).tolist() for _ in range(concurrency)]
    batch_sampling = [SamplingParams(max_tokens=int(rng.integers(1, 25 - len(p))),
                                     temperature=0.0 if i % 2 == 0 else 0.8, seed=i)
                      for i, p in enumerate(batch)]
    eng.generate(batch, batch_sampling)
    prompts += batch
    sampling += batch_sampling
  assert eng.stats()["compiles"] == report["programs"]  # nothing new
  # The same requests on an engine that never warmed up (bucketed prompt steps).
  fresh = Engine(cfg, params, EngineConfig(**CONFIG))
  want = [o.token_ids for o in fresh.generate(prompts, sampling)]
  got = [eng.output(i).token_ids for i in range(len(prompts))]
  assert got == want


def test_warmup_in_parts_between_requests_and_never_beside_one():
  # A server warming up in the background (`EngineLoop.warm_in_background`)
  # compiles one program at a time, only while no request is unfinished.
  cfg, params = _model()
  eng = Engine(cfg, params, EngineConfig(**CONFIG, fixed_prefill_shapes=True))
  todo = warmup.programs(eng)
  assert eng.warmup(programs=todo[:1])["programs"] == 1 == eng.stats()["compiles"]
  rid = eng.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
  with pytest.raises(RuntimeError, match="unfinished"):
    eng.warmup(programs=todo[1:2])
  while eng.has_unfinished():
    eng.step()
  assert len(eng.output(rid).token_ids) == 2
  compiled = eng.stats()["compiles"]
  assert eng.warmup(programs=todo[1:2])["programs"] <= 1
  assert eng.stats()["compiles"] in (compiled, compiled + 1)
  assert eng.stats()["steps"] > 0 and eng.output(rid).finish_reason == "length"


def test_prompt_token_buckets():
  from jaxinfer.engine import steps
  assert steps.prompt_token_buckets(1024) == [256, 1024]
  assert steps.prompt_token_buckets(256) == [64, 256]
  assert steps.prompt_token_buckets(40) == [16, 40]
  assert steps.prompt_token_buckets(16) == [16]
  assert steps.prompt_token_buckets(8) == [8]  # never past the budget


def test_fixed_shape_page_buckets_start_at_eight():
  """Fixed-shape step programs have at least 8 pages a sequence (a third
  fewer programs, and memory maps, for serve.py's 256-page context), or
  all of a shorter context's."""
  from jaxinfer.engine import steps
  assert warmup.page_buckets(256, True) == [8, 16, 32, 64, 128, 256]
  assert warmup.page_buckets(6, True) == [6]
  assert [steps.fixed_page_bucket(n, 256) for n in (1, 8, 9, 200)] == [8, 8, 16, 256]
  assert warmup.page_buckets(256, False)[:4] == [1, 2, 3, 4]  # bucketed engines: unchanged


def test_warmup_refuses_what_it_cannot_bound():
  cfg, params = _model()
  with pytest.raises(ValueError, match="fixed_prefill_shapes"):
    Engine(cfg, params, EngineConfig(**CONFIG)).warmup()
  with pytest.raises(ValueError, match="set one of them"):
    EngineConfig(fixed_step_shapes=True, fixed_prefill_shapes=True)
  cfg, params = _model(num_mtp_layers=1)
  spec = Engine(cfg, params, EngineConfig(**CONFIG, fixed_prefill_shapes=True,
                                          speculative=MTPConfig(num_draft_tokens=1)))
  with pytest.raises(ValueError, match="speculative"):
    spec.warmup()
