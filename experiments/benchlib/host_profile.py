"""Where an Engine step's host time goes on CPU: each part of the plain
runner's dispatch timed inside real decode steps (wall and thread CPU
time), then the same batch building and step call repeated with no step
computing (the call once behind a running step, once with its inputs
ready), and a trivial jit taking the same weight arrays.

In the engine the host works while the previous step computes on every
core, so its parts run slower there than alone; this measures both.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import numpy as np

from jaxinfer import models, presets
from jaxinfer.engine import Engine, EngineConfig, SamplingParams, scheduler, steps
from jaxinfer.engine import inspect as engine_inspect


def _ms(samples) -> float:
  return 1e3 * statistics.median(samples)


def run(model: str = "bench_moe", batch: int = 8, prompt_len: int = 128, new_tokens: int = 32,
        repeats: int = 30, decode_steps: int = 1) -> dict:
  """-> {in_engine: {part: {wall_ms, cpu_ms}}, alone: {part: ms}, param_leaves}
  (medians over the decode dispatches of the second of two generate runs,
  then `repeats` calls). decode_steps: `EngineConfig.decode_steps`; above 1
  the dispatch and the step call are the multi-step ones (`steps.step` with `steps.MultiStep`),
  each running decode_steps model steps."""
  cfg = presets.get(model)
  eng = Engine(cfg, models.init_params(cfg, jax.random.key(0)), EngineConfig(
      page_size=16, num_pages=batch * (-(-(prompt_len + new_tokens) // 16)) + 1,
      max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
      enable_prefix_caching=False, ignore_eos=True, decode_steps=decode_steps))
  wall, cpu, last = {}, {}, {}
  undo = []

  def timer(f, label):
    @functools.wraps(f)
    def timed(*a, **k):
      t0, c0 = time.perf_counter(), time.thread_time()
      out = f(*a, **k)
      wall.setdefault(label, []).append(time.perf_counter() - t0)
      cpu.setdefault(label, []).append(time.thread_time() - c0)
      last[label] = (a, k)
      return out
    return timed

  def wrap(obj, name, label):
    f = getattr(obj, name)
    setattr(obj, name, timer(f, label))
    undo.append((obj, name, f))

  multi = decode_steps > 1
  wrap(steps, "step", "step call")
  wrap(steps, "rank_batch", "rank_batch")
  wrap(scheduler, "schedule_ranks", "schedule")
  rng = np.random.default_rng(0)
  with engine_inspect.dispatch_hook(eng, lambda f, *a, **k: timer(f, "dispatch")(*a, **k)):
    for _ in range(2):
      eng.generate(rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist(),
                   SamplingParams(max_tokens=new_tokens))
  for obj, name, f in undo:
    setattr(obj, name, f)
  decodes = -(-(new_tokens - 1) // decode_steps)  # dispatches after the prefill
  in_engine = {k: dict(wall_ms=_ms(v[-decodes:]), cpu_ms=_ms(cpu[k][-decodes:]))
               for k, v in wall.items()}
  alone, leaves = _alone(eng, last, repeats, steps.step)
  return dict(in_engine=in_engine, alone=alone, param_leaves=leaves)


def _time(fn, repeats: int) -> float:
  t = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    t.append(time.perf_counter() - t0)
  return _ms(t)


def _alone(eng, last, repeats: int, step_fn):
  """The engine's last batch building and step call (step_fn) again, no step
  computing."""
  alone = {"rank_batch": _time(lambda: steps.rank_batch(*last["rank_batch"][0]), repeats)}
  a, k = last["step call"]
  model, _, inputs, program = a  # `steps.step(model, state, inputs, program)`
  params = model.params
  # Copies: the calls donate them, and the engine keeps its own.
  pool, load = engine_inspect.device_state_copy(eng)

  def call():
    nonlocal pool, load
    t0 = time.perf_counter()
    out, state, _ = step_fn(model, steps.StepState(pool, load), inputs, program, **k)
    pool, load = state.pool, state.load
    return time.perf_counter() - t0, out

  for mode in ("inputs ready", "behind a running step"):
    t = []
    for _ in range(repeats):
      dt, out = call()
      t.append(dt)
      if mode == "inputs ready":
        out.block_until_ready()
    out.block_until_ready()
    alone[f"step call, {mode}"] = _ms(t)
  trivial = jax.jit(lambda p: 0, keep_unused=True)
  trivial(params)
  alone["trivial jit of the same weights"] = _time(lambda: trivial(params), repeats)
  return alone, len(jax.tree.leaves(params))
