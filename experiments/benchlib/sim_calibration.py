"""Calibrating the cluster simulator on this machine, and checking it.

`calibrate_check` measures the real engine's step times while it serves a
calibration workload (through the real `Cluster`, one worker), fits a
`CalibratedCost` to them, then serves two other workloads for real and in
the simulator and compares tokens/s and mean TTFT.

What one measured "step time" is: the wall time from one cluster step's
end to the next's, when no idle wait lies between. That is the period of
the serving loop: scheduling, batch building, the device step, the token
read-back, the router's report and any arrivals submitted in between, so
the simulator's steps advance the clock as the real loop does. Steps run
with `async_scheduling=False` (one synchronous step per call, the
simulator's model of a step) and `fixed_step_shapes=True` (a handful of
programs, all compiled by an untimed warm-up, so no timed step compiles).

The machine is shared and its load drifts by minutes (step times here moved
3x between two calibration runs a minute apart), so the check runs in
rounds: calibrate, serve both workloads, calibrate again, ...; each round's
workloads are predicted from the fit to the two calibration runs that
bracket them in time, and each figure is judged by its median ratio
(predicted / measured) over the rounds.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from jaxinfer.engine.engine import EngineConfig
from jaxinfer.serving import workloads
from jaxinfer.serving.cluster import Cluster
from jaxinfer.sim.cost import CalibratedCost, step_shape
from jaxinfer.sim.engine import WorkerSpec
from jaxinfer.sim.simulator import Simulator
from jaxinfer.serving.worker import Worker

FEATURES = ("const", "tokens", "seqs", "padded_kv")


def calibration_workload(*, vocab_size: int, n: int = 96, seed: int = 0) -> list:
  """Bursts and lulls of requests of varied prompt (8..400) and output (4..48)
  lengths: steps from one sequence to full batches, short and long contexts,
  pure decode and mixed prefill, so every feature varies."""
  rng = np.random.default_rng([seed, 11])
  items, t = [], 0.0
  while len(items) < n:
    burst = int(rng.integers(1, 12))
    for _ in range(min(burst, n - len(items))):
      items.append(workloads.Item(
          arrival_s=t, max_tokens=int(rng.integers(4, 49)),
          prompt=tuple(rng.integers(0, vocab_size, int(rng.integers(8, 401))).tolist())))
    t += float(rng.exponential(0.4))
  return items


def measure_steps(cluster: Cluster, items) -> tuple[list, list, float]:
  """Serves `items` on `cluster` (one worker, synchronous steps) and records
  each step's `StepShape` with its loop period. -> (samples, outputs, wall_s)."""
  if len(cluster.workers) != 1:
    raise ValueError("measure_steps: give a one-worker cluster (steps of several workers "
                     "interleave on one host)")
  engine = cluster.workers[0].engine
  if engine.config.async_scheduling:
    raise ValueError("measure_steps: the engine needs EngineConfig(async_scheduling=False)")
  sch = engine.schedulers[0]
  dispatched = []
  original = sch.on_dispatch

  def on_dispatch(scheduled):
    dispatched.append(step_shape(scheduled, core=engine.core))
    original(scheduled)

  marks = []  # (time, shapes dispatched so far, work left after the step)

  def on_step(c, elapsed):
    marks.append((time.perf_counter(), len(dispatched), c.has_unfinished()))

  sch.on_dispatch = on_dispatch  # an instance attribute: this engine only
  try:
    t0 = time.perf_counter()
    outs = cluster.run(items, on_step=on_step)
    wall = time.perf_counter() - t0
  finally:
    del sch.on_dispatch
  samples = []
  for (t_a, n_a, busy), (t_b, n_b, _) in zip(marks, marks[1:]):
    if busy and n_b == n_a + 1:  # back-to-back steps, one dispatch between
      samples.append((dispatched[n_a], t_b - t_a))
  return samples, outs, wall


def _engine_config(*, page_size, num_pages, max_num_seqs, max_num_batched_tokens):
  return EngineConfig(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, fixed_step_shapes=True,
                      async_scheduling=False, ignore_eos=True)


def check_workloads(*, vocab_size: int, seed: int = 0) -> dict:
  """The two workloads the simulator must predict (neither is the
  calibration workload): an Offline-style burst of independent requests,
  and Poisson-started multi-turn conversations whose turns share prefixes."""
  return {
      "offline_burst": workloads.independent(
          64, float("inf"), vocab_size=vocab_size, min_len=16, max_len=256, max_tokens=32,
          seed=seed + 1),
      "poisson_multi_turn": workloads.multi_turn(
          10, 4, 1.5, vocab_size=vocab_size, system_len=64, user_len=32, reply_len=64,
          think_s=1.5, max_tokens=24, seed=seed + 2),
  }


def _measured(outs, wall) -> dict:
  ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
  return dict(tokens_per_s=sum(len(o.token_ids) for o in outs) / wall,
              mean_ttft_ms=float(np.mean(ttft)) * 1e3, wall_s=wall,
              output_tokens=sum(len(o.token_ids) for o in outs))


def _predict(cost, ec, items, seed) -> dict:
  s = Simulator([WorkerSpec(cost=cost, config=ec)], router="round_robin",
                seed=seed).run(items).summary(window=None)
  return dict(tokens_per_s=s["tokens_per_s"], mean_ttft_ms=s["ttft_ms"]["mean"],
              steps=s["why"]["mixed"]["steps"], mean_step_ms=s["why"]["mixed"]["mean_step_ms"],
              wall_s=s["duration_s"], output_tokens=s["output_tokens"])


def _check_row(name, items, preds: list[dict], measured: list[dict], tolerance) -> dict:
  """One check workload: predicted vs measured per round, medians and ratios."""
  row = dict(workload=name, **workloads.summary(items), rounds=len(preds),
             measured=_median(measured), predicted=_median(preds),
             measured_per_round=measured, predicted_per_round=preds)
  for key in ("tokens_per_s", "mean_ttft_ms"):
    ratios = [p[key] / m[key] for p, m in zip(preds, measured)]
    row[f"{key}_ratio"] = float(np.median(ratios))
    row[f"{key}_ratio_per_round"] = ratios
    row[f"{key}_within"] = bool(abs(row[f"{key}_ratio"] - 1) <= tolerance)
  return row


def calibrate_check(*, cfg, params, page_size: int = 16, num_pages: int = 512,
                    max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                    tolerance: float = 0.25, rounds: int = 3, seed: int = 0,
                    log=print) -> dict:
  """Fits the simulator's step-time model to this machine's measured steps
  and checks its predictions of two real workloads, in `rounds` rounds (see
  the module docstring). -> {"rows": per workload, "steps": measured vs
  fitted step times, "calibration": the fits}."""
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  ec = _engine_config(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens)
  make = lambda: Cluster([Worker(cfg, params, ec)], router="round_robin")
  calib = calibration_workload(vocab_size=cfg.vocab_size, seed=seed)
  checks = check_workloads(vocab_size=cfg.vocab_size, seed=seed)
  log("warm-up (untimed: compiles every page bucket's program)")
  for items in (calib, *checks.values()):
    make().run(items)
  cal, measured, loads = [], {name: [] for name in checks}, []

  def calibrate(i):
    log(f"calibration run {i} (load average {os.getloadavg()[0]:.1f})")
    loads.append(os.getloadavg()[0])
    cal.append(measure_steps(make(), calib)[0])

  calibrate(0)
  for r in range(rounds):
    for name, items in checks.items():
      log(f"round {r}: real run {name}")
      cluster = make()
      t0 = time.perf_counter()
      outs = cluster.run(items)
      m = _measured(outs, time.perf_counter() - t0)
      steps = cluster.workers[0].engine.stats()["steps"]
      measured[name].append(dict(m, steps=steps, mean_step_ms=m["wall_s"] / steps * 1e3))
    calibrate(r + 1)
  kw = dict(max_model_len=cfg.max_position_embeddings)
  fits = [CalibratedCost.fit(cal[r] + cal[r + 1], FEATURES, **kw) for r in range(rounds)]
  rows = [_check_row(name, items, [_predict(f, ec, items, seed) for f in fits],
                     measured[name], tolerance)
          for name, items in checks.items()]
  samples = [x for c in cal for x in c]
  pooled = CalibratedCost.fit(samples, FEATURES, **kw)
  steps = [dict(measured_ms=t * 1e3, predicted_ms=fits[min(i, rounds - 1)].predict(s) * 1e3,
                tokens=s.tokens, seqs=s.seqs,
                padded_kv=s.padded_seqs * s.padded_pages * s.page_size, run=i)
           for i, c in enumerate(cal) for s, t in c]
  return dict(rows=rows, steps=steps, calibration=dict(
      features=list(FEATURES), coef_per_round=[list(f.coef) for f in fits],
      coef_pooled=list(pooled.coef), samples_per_run=[len(c) for c in cal],
      mean_step_ms_per_run=[float(np.mean([t for _, t in c])) * 1e3 for c in cal],
      load_average_per_run=loads, tolerance=tolerance,
      fit_mean_abs_rel_err=float(np.mean([_rel_err(fits[min(i, rounds - 1)], c)
                                          for i, c in enumerate(cal)])),
      engine_config={k: v for k, v in dataclasses.asdict(ec).items() if k != "speculative"}))


def _median(runs: list[dict]) -> dict:
  return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def _rel_err(cost: CalibratedCost, samples) -> float:
  return float(np.mean([abs(cost.predict(s) - t) / t for s, t in samples]))
