"""The Engine's host work per decode step against its device step: the
host's own CPU time, the step's wall time and the device time, at several
batch sizes on a model of many narrow layers; then the same with the
device part made slow on purpose, where a loop that never waits on the
device inside a step takes max(host, device) a step.

What is measured, per steady decode step (`Engine.step` dispatching a
decode-only step and reading an earlier one):

- host CPU: the driving thread's CPU time (`time.thread_time`), which
  excludes the time it sleeps waiting on the device;
- host busy: the step's wall time less the time spent blocked in reads of
  device values (a `Probe` times every read of a jax array that was not
  ready yet);
- device: the last decode program alone, `repeats` calls dispatched back
  to back on each other's outputs, per call;
- blocking reads: reads of device values that had to wait, per step;
- order: whether step N + 1 was dispatched before step N's tokens were
  read (async scheduling);
- device idle: the share of decode dispatches that found the step before
  them already finished, the device waiting for the host (`is_ready` at
  dispatch; none where the host's work hides behind a longer device step,
  whatever else runs on the cores).

The slow mode appends to every step program a second program of a known
duration (`spin`: a loop over 1024 floats on one core, depending on the step's
samples, so the next step waits for it as for the step itself), sized to
`slow_factor` times the host's busy time. Dispatch stays asynchronous: the
step's call and the loop's return at once. A loop that overlaps its host
work with the device's takes max(host, device) a step; one that waits on
the device before dispatching the next step takes their sum. `overlap`
computes the ratio and checks it against a tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.engine import Engine, EngineConfig, SamplingParams, steps
from jaxinfer.engine import inspect as engine_inspect

BATCHES = (1, 64, 256)
# jax's concrete array class (its `_value` property is the one device-to-host read).
_ARRAY = type(jnp.zeros(()))


def model_config(num_layers: int = 32, d_model: int = 64, vocab_size: int = 256) -> ModelConfig:
  """A Llama of `num_layers` narrow layers (d_model wide, 4 heads of
  d_model / 4, 2 KV heads, FFN 2 x d_model), float32."""
  head_dim = d_model // 4
  return ModelConfig(model_type="llama", vocab_size=vocab_size, d_model=d_model,
                     num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     ffn_dim=2 * d_model, rope_theta=10000.0, max_position_embeddings=2048,
                     dtype="float32")


@jax.jit
def spin(sampled, iters):
  """sampled, after a loop of `iters` iterations over a vector of 1024
  floats on one core: a program of a known duration that depends on the
  step's samples. XLA:CPU runs a program it counts under 1000 flops
  ("cheap", the loop body counted once) in the calling thread when its
  inputs are ready; this one it always dispatches."""
  v = jnp.full((1024,), sampled.reshape(-1)[0], jnp.float32)
  v = lax.fori_loop(0, iters, lambda i, v: v * jnp.float32(0.999999) + jnp.float32(1e-6), v)
  return sampled + (v[0] == jnp.float32(-12345.0)).astype(sampled.dtype)


def spin_iters_per_ms(repeats: int = 5, iters: int = 20_000) -> float:
  """`spin` iterations per millisecond on this machine (median of repeats)."""
  x = jnp.zeros((1, 8), jnp.int32)
  spin(x, jnp.int32(iters)).block_until_ready()
  t = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    spin(x, jnp.int32(iters)).block_until_ready()
    t.append(time.perf_counter() - t0)
  return iters / (1e3 * statistics.median(t))


def overlap(wall_ms: float, host_ms: float, device_ms: float, tolerance: float = 0.1) -> dict:
  """The overlap check: a step's wall time against max(host, device).
  -> {ratio: wall / max, serial_ratio: (host + device) / max (what a loop
  that waits on the device before each dispatch would show), ok: ratio
  <= 1 + tolerance}."""
  top = max(host_ms, device_ms)
  ratio = wall_ms / top
  return dict(ratio=ratio, serial_ratio=(host_ms + device_ms) / top, tolerance=tolerance,
              ok=bool(ratio <= 1 + tolerance))


@dataclasses.dataclass
class _StepRecord:
  wall_s: float
  cpu_s: float
  blocked_s: float
  blocking_reads: int
  decode_dispatches: int  # decode-only step programs dispatched
  reads: int  # step outputs read


class Probe:
  """Instrumentation of an Engine's decode loop (a context manager):
  wraps `steps.step` (the order of dispatches; with spin_iters, a `spin`
  after each step) and jax arrays' host reads (the order of reads of step
  outputs; every read of a value not ready yet, timed)."""

  def __init__(self, spin_iters: int = 0):
    self.spin_iters = spin_iters
    self.log: list[tuple[str, int]] = []  # ("dispatch" | "read", step number)
    self.decode: set[int] = set()  # numbers of decode-only steps
    self.last_call = None  # (args, kwargs) of the last decode-only step call
    self.blocked_s = 0.0
    self.blocking_reads = 0
    self.idle: set[int] = set()  # decode steps dispatched after the step before them finished
    self._ids: dict[int, int] = {}  # id(step output) -> step number
    self._keep: list = []  # the step outputs, alive while their ids are keys
    self._undo = []

  def __enter__(self):
    step, value = steps.step, _ARRAY._value
    iters = jnp.int32(self.spin_iters)  # on device once, not each step

    @functools.wraps(step)
    def traced_step(*args, **kwargs):
      before_done = bool(self._keep) and self._keep[-1].is_ready()
      out = step(*args, **kwargs)
      sampled = out[0]
      if self.spin_iters:
        sampled = spin(sampled, iters)
      k = len(self._keep)
      self._keep.append(sampled)
      self._ids[id(sampled)] = k
      self.log.append(("dispatch", k))
      program = args[3]  # `steps.step(model, state, inputs, program)`
      if type(program.decoder) is steps.Plain and program.max_q == 1:
        self.decode.add(k)
        if before_done:
          self.idle.add(k)
        self.last_call = (args, kwargs)
      return (sampled, *out[1:])

    def read(array):
      k = self._ids.get(id(array))
      if k is not None:
        self.log.append(("read", k))
      if array.is_ready():
        return value.fget(array)
      t0 = time.perf_counter()
      out = value.fget(array)
      self.blocked_s += time.perf_counter() - t0
      self.blocking_reads += 1
      return out

    steps.step = traced_step
    _ARRAY._value = property(read)
    self._undo = [(steps, "step", step), (_ARRAY, "_value", value)]
    return self

  def __exit__(self, *exc):
    for obj, name, f in self._undo:
      setattr(obj, name, f)
    self._undo = []

  def counts(self) -> tuple[int, int, int, int]:
    """(decode dispatches, step reads, blocking reads, blocked seconds) so far."""
    dispatches = sum(1 for what, k in self.log if what == "dispatch" and k in self.decode)
    reads = sum(1 for what, _ in self.log if what == "read")
    return dispatches, reads, self.blocking_reads, self.blocked_s

  def dispatched_before_read(self) -> list[bool]:
    """For each decode step N followed by a decode step N + 1: whether N + 1
    was dispatched before N's samples were first read."""
    at = {}
    for i, event in enumerate(self.log):
      at.setdefault(event, i)
    return [at[("dispatch", k + 1)] < at[("read", k)] for k in sorted(self.decode)
            if k + 1 in self.decode and ("read", k) in at]

  def device_idle(self) -> float | None:
    """The share of decode steps N + 1 (after a decode step N) dispatched
    after step N had finished: the device waited for the host."""
    follows = [k for k in sorted(self.decode) if k - 1 in self.decode]
    return sum(k in self.idle for k in follows) / len(follows) if follows else None


def _engine(cfg: ModelConfig, params, batch: int, prompt_len: int, new_tokens: int, *,
            unroll_layers: bool, async_scheduling: bool) -> Engine:
  pages = -(-(prompt_len + new_tokens) // 16)
  return Engine(cfg, params, EngineConfig(
      page_size=16, num_pages=2 * batch * pages + 1, max_num_seqs=batch,
      max_num_batched_tokens=max(batch * prompt_len, 256), ignore_eos=True,
      unroll_layers=unroll_layers, cpu_weight_layout="in_out",
      async_scheduling=async_scheduling))


def _decode_loop(eng: Engine, prompts, new_tokens: int, probe: Probe) -> list[_StepRecord]:
  """Runs prompts to completion one `Engine.step` at a time -> each step's record."""
  sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0)
  for p in prompts:
    eng.submit(p, sampling)
  records = []
  while eng.has_unfinished():
    before = probe.counts()
    t0, c0 = time.perf_counter(), time.thread_time()
    eng.step()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    after = probe.counts()
    d, r, b, s = (a - x for a, x in zip(after, before))
    records.append(_StepRecord(wall, cpu, s, b, d, r))
  return records


def _steady(records: list[_StepRecord]) -> list[_StepRecord]:
  """The steps that dispatched one decode step and read one step (the
  prompt step, its read and the drain at the end left out)."""
  return [r for r in records if r.decode_dispatches == 1 and r.reads == 1]


def _device_ms(call, eng: Engine, repeats: int, spin_iters: int = 0) -> float:
  """The device time of the last decode program (and its spin): `repeats`
  calls dispatched back to back, each on the previous one's samples and
  pool as in the engine, then waited for -> ms per call. The host's
  dispatches overlap the device's work, so this is the device's time."""
  args, kwargs = call
  model, state, inputs, program = args
  prev, load = inputs.prev, state.load
  # Copies: the calls donate the pool and the load, and the engine keeps its own.
  pool, copied = engine_inspect.device_state_copy(eng)
  load = load if load is None else copied

  def one(prev, pool, load):
    sampled, state, _ = steps.step(model, steps.StepState(pool, load),
                                   dataclasses.replace(inputs, prev=prev), program, **kwargs)
    pool, load = state.pool, state.load
    if spin_iters:
      sampled = spin(sampled, jnp.int32(spin_iters))
    return sampled, pool, load

  prev, pool, load = one(prev, pool, load)
  prev.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    prev, pool, load = one(prev, pool, load)
  prev.block_until_ready()
  return 1e3 * (time.perf_counter() - t0) / repeats


def _summary(records: list[_StepRecord], probe: Probe) -> dict:
  steady = _steady(records)
  if not steady:
    raise ValueError("no steady decode step: give more new_tokens")
  med = lambda xs: 1e3 * statistics.median(xs)
  order = probe.dispatched_before_read()
  return dict(
      steps=len(steady),
      host_cpu_ms=med([r.cpu_s for r in steady]),
      host_ms=med([r.wall_s - r.blocked_s for r in steady]),
      wall_ms=med([r.wall_s for r in steady]),
      blocking_reads_per_step=max(r.blocking_reads for r in steady),
      dispatched_before_read=(sum(order) / len(order)) if order else None,
      device_idle=probe.device_idle())


def run_batch(cfg: ModelConfig, params, batch: int, *, prompt_len: int = 16,
              new_tokens: int = 32, unroll_layers: bool = True, async_scheduling: bool = True,
              slow_factor: float = 2.0, slow_ms: float | None = None, repeats: int = 10,
              tolerance: float = 0.1, iters_per_ms: float | None = None, seed: int = 0) -> dict:
  """One batch size: a warm-up run (compiles), the timed run, then the
  slow-device run. -> {batch, normal: {...}, slow: {...}} (see the module
  docstring; both with `overlap`'s check)."""
  eng = _engine(cfg, params, batch, prompt_len, new_tokens, unroll_layers=unroll_layers,
                async_scheduling=async_scheduling)
  rng = np.random.default_rng(seed)
  prompts = lambda: rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
  with Probe() as warm:
    _decode_loop(eng, prompts(), new_tokens, warm)
  with Probe() as probe:
    records = _decode_loop(eng, prompts(), new_tokens, probe)
  normal = _summary(records, probe)
  normal["device_ms"] = _device_ms(probe.last_call, eng, repeats)
  normal.update(overlap=overlap(normal["wall_ms"], normal["host_ms"], normal["device_ms"],
                                tolerance))
  iters_per_ms = iters_per_ms or spin_iters_per_ms()
  spin_ms = slow_ms if slow_ms is not None else slow_factor * normal["host_ms"]
  iters = max(1, int(spin_ms * iters_per_ms))
  with Probe(iters) as probe:
    records = _decode_loop(eng, prompts(), new_tokens, probe)
  slow = _summary(records, probe)
  slow["spin_ms"] = spin_ms
  slow["device_ms"] = _device_ms(probe.last_call, eng, repeats, iters)
  slow.update(overlap=overlap(slow["wall_ms"], slow["host_ms"], slow["device_ms"], tolerance))
  return dict(batch=batch, weight_arrays=len(jax.tree.leaves(engine_inspect.step_params(eng))),
              normal=normal, slow=slow)


def run(batches=BATCHES, *, num_layers: int = 32, d_model: int = 64, vocab_size: int = 256,
        prompt_len: int = 16, new_tokens: int = 32, unroll_layers: bool = True,
        async_scheduling: bool = True, slow_factor: float = 2.0, slow_ms: float | None = None,
        repeats: int = 10, tolerance: float = 0.1) -> dict:
  """`run_batch` at each batch size on one model (`model_config`, random
  weights). -> {model: {...}, weight_arrays, iters_per_ms, rows: [...]}."""
  cfg = model_config(num_layers, d_model, vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  iters_per_ms = spin_iters_per_ms()
  rows = [run_batch(cfg, params, b, prompt_len=prompt_len, new_tokens=new_tokens,
                    unroll_layers=unroll_layers, async_scheduling=async_scheduling,
                    slow_factor=slow_factor, slow_ms=slow_ms, repeats=repeats,
                    tolerance=tolerance, iters_per_ms=iters_per_ms)
          for b in batches]
  return dict(model=dict(num_layers=num_layers, d_model=d_model, vocab_size=vocab_size,
                         dtype="float32", unroll_layers=unroll_layers,
                         prompt_len=prompt_len, new_tokens=new_tokens),
              iters_per_ms=iters_per_ms, rows=rows)
