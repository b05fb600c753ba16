"""A serving worker: an `Engine` on its own devices (a sub-mesh with its own
layout) and a role.

  mixed    prefills and decodes its requests (co-located serving)
  prefill  computes prompts' K/V for decode workers (disaggregated serving)
  decode   decodes requests, prefilled remotely or, when that does not pay,
           locally (conditional disaggregation)

Several workers live in one process. `step` dispatches the worker's next
device step and reads back the previous one (async scheduling), so a loop
stepping the workers in turn keeps all their devices busy: one worker never
waits on another's device work.
"""

from __future__ import annotations

from typing import Sequence

from jaxinfer import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.engine.engine import Engine, EngineConfig

ROLES = ("mixed", "prefill", "decode")


class WorkerStopped(RuntimeError):
  """Raised by a stopped worker's `step`."""


class EngineWorker:
  """An engine with a role, a name and a liveness: what the request flow
  (`flow.Flow`) routes to. The engine is an `Engine` (a `Worker`) or the
  cluster simulator's engine over modelled step times."""

  def __init__(self, engine, *, role: str = "mixed", name: str | None = None):
    if role not in ROLES:
      raise ValueError(f"{type(self).__name__}: role must be one of {ROLES}, got {role!r}")
    self.engine, self.role = engine, role
    self.name = name or role
    self.alive = True
    self.error: str | None = None

  @property
  def page_size(self) -> int:
    return self.engine.config.page_size

  def has_work(self) -> bool:
    return self.alive and self.engine.has_unfinished()

  def stop(self, reason: str = "stopped") -> None:
    """Takes the worker out of service; its requests are the caller's to re-route."""
    self.alive = False
    self.error = reason

  def load(self) -> dict:
    """The load a router weighs (`load_report`)."""
    return load_report(self.engine.schedulers, self.engine.allocators)

  def take_events(self) -> list[tuple[str, bytes]]:
    """The allocators' prefix-page events since the last call (`drain_events`)."""
    return drain_events(self.engine.allocators)


class Worker(EngineWorker):
  """An `Engine` on its own devices with a role ("mixed", "prefill", "decode")."""

  def __init__(self, cfg: ModelConfig, params, config: EngineConfig | None = None, *,
               role: str = "mixed", devices: Sequence | None = None,
               mesh_axes: dict | None = None, layout: sharding.LayoutLike = "tp",
               name: str | None = None):
    """devices: this worker's devices (default: the first device, no mesh);
    mesh_axes: their mesh shape (default {"tensor": len(devices)});
    layout: `sharding` layout on that mesh (a `sharding.Layout` or its name:
    "tp", "tp_attn_ep", "dp_attn_ep")."""
    if role not in ROLES:
      raise ValueError(f"Worker: role must be one of {ROLES}, got {role!r}")
    if devices is None and mesh_axes is not None:
      raise ValueError("Worker: mesh_axes needs devices")
    mesh = None
    if devices is not None:
      devices = list(devices)
      if not devices:
        raise ValueError("Worker: devices is empty")
      mesh = sharding.make_mesh(mesh_axes or {"tensor": len(devices)}, devices)
    super().__init__(Engine(cfg, params, config, mesh=mesh, layout=layout if mesh else None),
                     role=role, name=name)
    self.layout = sharding.as_layout(layout) if mesh else None
    self.devices = devices
    self._fail_after: int | None = None
    self.steps = 0

  def step(self) -> list[tuple[int, list[int], bool]]:
    """Advances the engine one step (no-op without work) -> its events."""
    if not self.alive:
      raise WorkerStopped(f"worker {self.name} is stopped ({self.error})")
    if self._fail_after is not None and self.steps >= self._fail_after:
      raise RuntimeError(f"injected fault after {self.steps} steps")
    if not self.engine.has_unfinished():
      return []
    self.steps += 1
    return self.engine.step()

  def stop(self, reason: str = "stopped") -> None:
    """Takes the worker out of service and frees its engine's device memory
    (`Engine.release`): a stopped worker keeps no KV pool or weights."""
    super().stop(reason)
    self.engine.release()

  def fail_after(self, steps: int) -> None:
    """Fault injection: `step` raises once the worker has run `steps` steps."""
    self._fail_after = steps

  def __repr__(self) -> str:
    devs = "default device" if self.devices is None else f"{len(self.devices)} devices"
    return f"Worker({self.name!r}, role={self.role}, {devs}, layout={self.layout})"


def load_report(schedulers, allocators) -> dict:
  """The load a router weighs, from an engine's schedulers and allocators
  (one per DP rank): prompt tokens still to compute (queued and running)
  and KV pages in use."""
  active = 0
  for sch in schedulers:
    for req in (*sch.waiting, *sch.running):
      active += max(0, len(req.prompt) - req.num_computed)
  return dict(active_prefill_tokens=active, decode_pages=sum(a.num_used() for a in allocators))


def drain_events(allocators) -> list[tuple[str, bytes]]:
  """The allocators' prefix-page events ("stored" | "evicted", hash) since
  the last call, for `Router.report`."""
  events = []
  for a in allocators:
    events += a.events
    a.events = []
  return events
