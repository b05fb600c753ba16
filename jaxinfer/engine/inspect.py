"""A read-only window into an Engine's device state, for the benchmarks
(`experiments/benchlib`) and notebooks: what they time or measure without
reaching into the Engine's private attributes.

  step_params(engine)        the weights as the step takes them (its layout)
  expert_load_array(engine)  the recorded expert load, on device (or None)
  device_state_copy(engine)  copies of (pool, expert load) a step may donate
  dispatch_hook(engine, fn)  a context manager: every step dispatch runs
                             through fn(dispatch, *args, **kwargs)

Nothing here changes what the Engine computes; `dispatch_hook` restores the
runner's dispatch on exit. The Engine attributes read here (kept in step with
`engine.py`): `Engine._model` (a `steps.StepModel`, `.params`),
`Engine._load`, `Engine.pool` and `Engine._runner` (its `_dispatch`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def step_params(engine):
  """The weights as the Engine's step takes them (per layer where the step
  unrolls layers; placed on the Engine's mesh): the pytree a step call
  receives. `Engine.params` is the stacked form, rebuilt on each call."""
  return engine._model.params


def expert_load_array(engine):
  """The expert load the steps record, int [Lm, E] on device, or None where
  none is recorded (`Engine.expert_load()` is the host copy)."""
  return engine._load


def device_state_copy(engine):
  """Copies of (page pool, expert load or None): what a step call made
  outside the Engine may donate, the Engine keeping its own."""
  return jax.tree.map(jnp.copy, (engine.pool, engine._load))


@contextlib.contextmanager
def dispatch_hook(engine, fn):
  """While open, each step dispatch of the Engine's runner calls
  fn(dispatch, *args, **kwargs) instead of dispatch(*args, **kwargs) (fn
  must call dispatch and return its result: the new `steps.StepState`)."""
  runner = engine._runner
  own = vars(runner).get("_dispatch")  # an instance attribute, if one was set
  dispatch = runner._dispatch
  runner._dispatch = lambda *a, **k: fn(dispatch, *a, **k)
  try:
    yield
  finally:
    if own is None:
      del runner._dispatch  # the class's method again
    else:
      runner._dispatch = own
