"""A worker spanning several processes: `WorkerSpec(num_processes=N)` starts
N Ray actors that join one `jax.distributed` group (process 0's host runs
the coordinator) and build one engine on one global mesh, the way a model
too big for one host is served (multi-controller JAX: every process runs
the same program on its own devices' shards).

The driver sees the group as one actor (`ActorGroup`): every call
(`submit`, `abort`, `step`, `reserve_pages`, `stats`, ...) is sent to all N
processes, in the same order, so their host state (schedulers, allocators,
request ids) stays identical and their device steps meet in the same
collectives; the answer is process 0's. The others' answers are equal and
dropped: a process that fails or dies breaks process 0's next collective
(on CPU gloo raises at once: "Connection reset by peer"; a hang is ended by
the cluster's step timeout), so the group is taken out and its requests
re-routed, and killing the group kills every process.
"""

from __future__ import annotations

import os

from jaxinfer.serving.remote_engine import ray_module
from jaxinfer.serving.ray_worker import WorkerProcess, WorkerSpec


class _Broadcast:
  """`group.method` : `.remote(...)` calls it on every process -> process 0's ref."""

  def __init__(self, actors, name: str, options: dict | None = None):
    self.actors, self.name, self.opts = actors, name, options or {}

  def options(self, **options) -> "_Broadcast":
    return _Broadcast(self.actors, self.name, dict(self.opts, **options))

  def remote(self, *args, **kwargs):
    refs = []
    for a in self.actors:
      method = getattr(a, self.name)
      refs.append((method.options(**self.opts) if self.opts else method).remote(*args, **kwargs))
    return refs[0]


class ActorGroup:
  """The N actors of one multi-process worker, called as one actor."""

  def __init__(self, actors):
    self.actors = list(actors)

  def __getattr__(self, name: str) -> _Broadcast:
    if name.startswith("_"):
      raise AttributeError(name)
    return _Broadcast(self.actors, name)


def start_actor(spec: WorkerSpec, package_root: str, start_timeout_s: float):
  """An actor in a process of its own importing the jaxinfer at
  package_root, or for num_processes > 1 an `ActorGroup` of them, joining
  their `jax.distributed` group (without waiting for the join)."""
  ray = ray_module()
  env = dict(spec.env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
  make = lambda: ray.remote(WorkerProcess).options(
      num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=0,
      runtime_env={"env_vars": env}).remote(spec)
  if spec.num_processes == 1:
    return make()
  group = ActorGroup(make() for _ in range(spec.num_processes))
  try:
    address = ray.get(group.actors[0].coordinator_address.remote(), timeout=start_timeout_s)
  except Exception:
    kill(group)
    raise
  for k, a in enumerate(group.actors):
    a.join.remote(address, k)
  return group


def kill(actor) -> None:
  """Kills an actor, or every process of an `ActorGroup` (gone ones ignored)."""
  for a in actor.actors if isinstance(actor, ActorGroup) else [actor]:
    try:
      ray_module().kill(a, no_restart=True)
    except Exception:  # noqa: BLE001, S110 - already gone
      pass
