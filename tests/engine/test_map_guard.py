"""`engine.map_guard`: a process near vm.max_map_count drops jax's compiled
programs before compiling another (past the limit XLA:CPU's compile
segfaults: docs/known_issues.md), the warm-up stops short of its share, and
the Engine's tokens do not change when its programs are dropped mid-run."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import Engine, EngineConfig, SamplingParams, models, presets
from jaxinfer.engine import map_guard, warmup

CONFIG = dict(page_size=8, num_pages=64, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=24)


def _maps(monkeypatch, held: dict):
  """memory_maps() reports held["n"] of a limit of 1000; jax.clear_caches
  counted in held["clears"] (and still run)."""
  held.setdefault("clears", 0)
  monkeypatch.setattr(map_guard, "memory_maps", lambda: (held["n"], 1000))
  real = jax.clear_caches

  def clear():
    held["clears"] += 1
    real()
  monkeypatch.setattr(jax, "clear_caches", clear)


def test_memory_maps_reads_this_process():
  maps = map_guard.memory_maps()
  assert maps is not None  # Linux, here and in CI
  count, limit = maps
  assert 0 < count < limit
  assert map_guard.room(1.0)


def test_guard_clears_before_a_new_program_past_its_fraction(monkeypatch):
  held = {"n": 100}
  _maps(monkeypatch, held)
  a, b = map_guard.ProgramGuard(0.85), map_guard.ProgramGuard(0.85)
  a.before("p1")
  held["n"] = 900
  a.before("p1")  # compiled already: nothing to map
  assert held["clears"] == 0
  a.before("p2")  # new, at 90% of the limit: everything dropped first
  assert held["clears"] == 1 and a.clears == 1
  held["n"] = 100
  b.before("q1")
  assert held["clears"] == 1
  held["n"] = 900
  b.before("q2")
  assert held["clears"] == 2 and b.clears == 1
  a.before("p2")  # b's clear dropped a's programs too: a checks again
  assert held["clears"] == 3
  assert not map_guard.room(0.85) and map_guard.room(0.95)
  with pytest.raises(ValueError, match="fraction"):
    map_guard.ProgramGuard(0.0)


def _model():
  cfg = dataclasses.replace(presets.get("tiny_dense", num_layers=1), dtype="float32")
  return cfg, models.init_params(cfg, jax.random.key(0))


def test_warmup_stops_at_its_share_and_traffic_compiles_the_rest(monkeypatch):
  cfg, params = _model()
  held = {"n": 100}
  _maps(monkeypatch, held)
  eng = Engine(cfg, params, EngineConfig(**CONFIG, fixed_prefill_shapes=True))
  total = len(warmup.programs(eng))
  real_room = map_guard.room
  calls = {"n": 0}

  def room(fraction):  # room for three programs
    calls["n"] += 1
    return calls["n"] <= 3 and real_room(fraction)
  monkeypatch.setattr(map_guard, "room", room)
  report = eng.warmup()
  assert report["programs"] == 3 and report["left_out"] == total - 3
  prompts = [[5, 6, 7], list(range(1, 12))]
  sp = SamplingParams(max_tokens=6, temperature=0.0)
  got = [o.token_ids for o in eng.generate(prompts, sp)]
  want = [o.token_ids for o in Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sp)]
  assert got == want


def test_programs_dropped_mid_run_leave_the_tokens_unchanged(monkeypatch):
  """Every new program finds the process at 90% of the limit: the guard
  drops all compiled programs before each (while earlier steps' results
  are still in flight, async scheduling), and greedy and seeded sampled
  tokens equal those of an engine that never dropped any."""
  cfg, params = _model()
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 14)]
  sp = [SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=5, temperature=0.9, seed=3),
        SamplingParams(max_tokens=8, temperature=0.0)]
  want = [o.token_ids for o in Engine(cfg, params, EngineConfig(**CONFIG)).generate(prompts, sp)]
  held = {"n": 900}
  _maps(monkeypatch, held)
  eng = Engine(cfg, params, EngineConfig(**CONFIG))
  got = [o.token_ids for o in eng.generate(prompts, sp)]
  assert held["clears"] >= 3 and held["clears"] == eng._runner.guard.clears
  assert got == want
