"""The serving soak's CI version (`jaxinfer.serving.soak`; the 10-minute run
is `experiments/soak.py`): random arrivals, aborts, a worker stopped and
replaced, stalled transfers and a bounded queue over a prefill + decode +
mixed cluster of the default model, plain, multi-step and speculative,
with every serving invariant checked after every step."""

import dataclasses

import numpy as np
import pytest

import jaxinfer
from jaxinfer.serving import soak


@pytest.fixture(scope="module")
def default_model():
  return jaxinfer.load_default_model()


# Speculative steps, and plain multi-step decodes (CI time: plain single steps
# are the engine tests' default, and experiments/soak.py runs them long).
@pytest.mark.parametrize("speculative,decode_steps,seed", [(2, 1, 2), (0, 4, 4)])
def test_short_soak_keeps_every_invariant(default_model, speculative, decode_steps, seed):
  engine = dataclasses.replace(soak.SoakConfig().engine, decode_steps=decode_steps)
  config = soak.SoakConfig(steps=32, seed=seed, speculative=speculative,
                           engine=engine,
                           restart_every_steps=15, arrivals_per_step=1.0, abort_prob=0.3,
                           stall_prob=0.1, max_queue=6, max_tokens=12, pool_size=12)
  report = soak.soak(*default_model, config)
  assert report["violations"] == 0
  # The faults happened and the traffic was served, refused or aborted, none lost.
  assert report["restarts"] >= 2 and report["stalls"] >= 1 and report["aborts"] >= 1
  assert report["accepted"] + report["refused"] == report["submitted"]
  assert sum(report["ended"].values()) == report["accepted"]
  assert report["ended"].get("length", 0) + report["ended"].get("stop", 0) > 0


def test_the_checks_catch_a_wrong_token_and_a_leak(default_model):
  """The invariants can fail: a token that is not the reference greedy
  token, and a page reference nobody holds, each raise SoakViolation."""
  cfg, params, tok = default_model
  run = soak.Soak(cfg, params, tok, soak.SoakConfig(steps=0, pool_size=4, max_tokens=3))
  cid = run.cluster.submit(run.pool[0], jaxinfer.SamplingParams(max_tokens=3, temperature=0.0))
  run.prompt_of[cid] = 0
  run.reference = [list(np.add(r, 1) % cfg.vocab_size) for r in run.reference]  # a wrong model
  with pytest.raises(soak.SoakViolation, match="reference greedy tokens"):
    for step in range(100):
      run.cluster.step()
      run._check_requests(step)
  run._check_pages(0)
  run.cluster.workers[1].engine.allocators[0].allocate(1)  # taken, held by nobody
  with pytest.raises(soak.SoakViolation, match="have refcounts"):
    run._check_pages(1)
