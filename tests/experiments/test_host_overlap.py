"""`benchlib.host_overlap` runs an Engine's decode loop under its probe and
reports, per mode, the host, device and wall times per step with the
overlap check; with async scheduling each step reads device values at most
once and dispatches step N + 1 before reading step N's tokens, without it
every step is read before the next is dispatched. No time bound here: the
figures are the benchmark's (experiments/host_overlap.py)."""

import jax
import pytest

from benchlib import host_overlap
from jaxinfer import models

FIELDS = {"steps", "host_cpu_ms", "host_ms", "wall_ms", "device_ms", "blocking_reads_per_step",
          "dispatched_before_read", "device_idle", "overlap"}


def test_the_overlap_check_passes_a_hidden_host_and_fails_a_serial_loop():
  hidden = host_overlap.overlap(wall_ms=10.5, host_ms=4.0, device_ms=10.0)
  assert hidden["ok"] and hidden["ratio"] == pytest.approx(1.05)
  assert hidden["serial_ratio"] == pytest.approx(1.4)
  serial = host_overlap.overlap(wall_ms=14.0, host_ms=4.0, device_ms=10.0)
  assert not serial["ok"] and serial["ratio"] == pytest.approx(serial["serial_ratio"])
  # The larger of the two is the bound, whichever it is.
  assert host_overlap.overlap(wall_ms=5.2, host_ms=5.0, device_ms=1.0)["ok"]
  assert not host_overlap.overlap(wall_ms=5.2, host_ms=5.0, device_ms=1.0, tolerance=0.01)["ok"]


@pytest.fixture(scope="module")
def tiny():
  cfg = host_overlap.model_config(num_layers=2, d_model=32, vocab_size=64)
  return cfg, models.init_params(cfg, jax.random.key(0))


def _run(tiny, async_scheduling):
  cfg, params = tiny
  return host_overlap.run_batch(cfg, params, 2, prompt_len=6, new_tokens=6, unroll_layers=False,
                                async_scheduling=async_scheduling, slow_ms=1.0, repeats=2,
                                iters_per_ms=1000.0)


def test_a_run_reports_both_modes_and_reads_once_per_step_after_the_next_dispatch(tiny):
  r = _run(tiny, async_scheduling=True)
  assert r["batch"] == 2 and r["weight_arrays"] > 5
  assert r["slow"]["spin_ms"] == 1.0
  for mode in ("normal", "slow"):
    m = r[mode]
    assert FIELDS <= set(m), mode
    assert m["steps"] >= 2
    assert m["blocking_reads_per_step"] <= 1
    assert m["dispatched_before_read"] == 1.0  # step N + 1 went out before N was read
    assert 0.0 <= m["device_idle"] <= 1.0
    assert 0 < m["host_cpu_ms"] and 0 < m["host_ms"] <= m["wall_ms"] and m["device_ms"] > 0
    o = m["overlap"]
    top = max(m["host_ms"], m["device_ms"])
    assert o["ratio"] == pytest.approx(m["wall_ms"] / top)
    assert o["ok"] == (o["ratio"] <= 1 + o["tolerance"])


def test_without_async_scheduling_each_step_is_read_before_the_next_dispatch(tiny):
  r = _run(tiny, async_scheduling=False)
  for mode in ("normal", "slow"):
    assert r[mode]["dispatched_before_read"] == 0.0, mode
    assert r[mode]["device_idle"] == 1.0, mode  # each step found the one before it done
    assert r[mode]["blocking_reads_per_step"] <= 1
