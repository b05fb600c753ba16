"""A serving worker in its own process: what a Ray actor runs.

`WorkerSpec` says how to build the worker (picklable: the model by name or
config, its params by source, the `EngineConfig`, the role); `WorkerProcess`
is the actor's body. The driver (`ray_cluster.RayCluster`) names requests
with its own ids ("keys"), so submissions, aborts and page releases need no
answer and are sent without waiting; each `step` answers with everything the
request flow reads between steps: the engine's events, finished requests'
outputs, held prefill pages and MTP drafts, the load and the prefix-page
events for the router.

KV hand-over between processes, two transports:
  "jax"           jax's transfer library (`jax.experimental.transfer`): the
                  prefill process offers the pages' K/V (device arrays) on
                  its transfer server; the decode process pulls them straight
                  onto its device and writes them into its reservation.
  "object_store"  the prefill process returns the K/V as host arrays into
                  Ray's object store; the decode process gets the object
                  (shared memory on one host) and writes it.

A worker may span several processes (`WorkerSpec.num_processes`, e.g. one
per host): a `jax.distributed` group with one global mesh, every process
running the same engine on the same commands (SPMD, multi-controller; see
`ray_group`).

This module does not import ray: the actor class is made in `ray_cluster`.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import jax
from jax.experimental import transfer
import numpy as np

from jaxinfer import checkpoint, models, presets, sharding
from jaxinfer.config import ModelConfig
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.run import load_default_model
from jaxinfer.serving.worker import ROLES, Worker


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
  """How to build a worker in another process.

  model: "default" (the bundled model, `jaxinfer.load_default_model`), a
  `presets` name, or a `ModelConfig`.
  params: None (the bundled params for "default", else
  `models.init_params(cfg, jax.random.key(seed))`), a params pytree of host
  arrays, or a Ray `ObjectRef` to one (`ray.put` once, shared by workers).
  checkpoint: an HF model directory (`checkpoint.load_hf`) instead.
  num_cpus / num_gpus: the actor's Ray resources. env: environment variables
  of the worker process (e.g. JAX_PLATFORMS, XLA_FLAGS).
  num_processes: processes (Ray actors, each with these resources and env)
  the worker spans, joined by `jax.distributed` into one global mesh; > 1
  serves role "mixed" only (no KV hand-over between process groups yet).
  mesh_axes / layout: the engine's mesh over all the worker's devices
  (default: none for one process, {"tensor": every device} for a group)
  and its `sharding` layout.
  """

  model: str | ModelConfig = "default"
  params: object = None
  checkpoint: str | None = None
  seed: int = 0
  config: EngineConfig | None = None
  role: str = "mixed"
  name: str | None = None
  num_cpus: float = 1.0
  num_gpus: float = 0.0
  env: dict = dataclasses.field(default_factory=dict)
  num_processes: int = 1
  mesh_axes: dict | None = None
  layout: str = "tp"

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"WorkerSpec: role must be one of {ROLES}, got {self.role!r}")
    if not (isinstance(self.num_processes, int) and self.num_processes >= 1):
      raise ValueError(f"WorkerSpec: num_processes must be an integer >= 1, got "
                       f"{self.num_processes!r}")
    if self.num_processes > 1 and self.role != "mixed":
      raise ValueError(f"WorkerSpec: a worker of num_processes={self.num_processes} serves "
                       f"role 'mixed' only, got {self.role!r}")
    if not isinstance(self.model, (str, ModelConfig)):
      raise TypeError(f"WorkerSpec: model must be 'default', a preset name or a ModelConfig, "
                      f"got {type(self.model).__name__}")
    if self.checkpoint is not None and self.params is not None:
      raise ValueError("WorkerSpec: give params or checkpoint, not both")

  def load(self):
    """-> (cfg, params), in the worker process."""
    if self.checkpoint is not None:
      return checkpoint.load_hf(self.checkpoint)
    if self.model == "default":
      cfg, params, _ = load_default_model()
    else:
      cfg = presets.get(self.model) if isinstance(self.model, str) else self.model
      params = None
    params = self.params if self.params is not None else params
    if params is None:
      params = models.init_params(cfg, jax.random.key(self.seed))
    elif type(params).__name__ == "ObjectRef":
      import ray  # noqa: PLC0415 - only inside an actor, where ray is installed
      params = ray.get(params)
    # A group's processes each hand the engine the whole (host) array; it
    # places its shards of the global mesh (`sharding.shard_params`).
    return cfg, jax.tree.map(np.asarray if self.num_processes > 1 else jax.numpy.asarray, params)


class WorkerProcess:
  """The body of a worker actor: a `Worker` driven by a `RayCluster`. A
  process of a multi-process worker builds it in `join`, not here."""

  def __init__(self, spec: WorkerSpec):
    self.spec = spec
    self._server = None  # the jax transfer server, started on first use
    self._conns: dict[str, object] = {}  # peers' transfer servers
    if spec.num_processes == 1:
      self._build()

  def coordinator_address(self) -> str:
    """host:port for a group's `jax.distributed` coordinator on this host."""
    with socket.socket() as s:
      s.bind(("", 0))
      return f"{socket.gethostbyname(socket.gethostname())}:{s.getsockname()[1]}"

  def join(self, coordinator_address: str, process_id: int) -> None:
    """Joins the worker's `jax.distributed` group (before any JAX work in
    this process), then builds the engine on the group's global mesh."""
    sharding.initialize_distributed(coordinator_address, self.spec.num_processes, process_id)
    self._build()

  def _build(self) -> None:
    self._model = self.spec.load()
    self.reset()

  def reset(self) -> dict:
    """A fresh engine (empty caches; this process's compiled programs stay)
    -> `info`."""
    spec = self.spec
    devices = jax.devices() if spec.num_processes > 1 or spec.mesh_axes else None
    self.worker = Worker(*self._model, spec.config, role=spec.role, name=spec.name,
                         devices=devices, mesh_axes=spec.mesh_axes, layout=spec.layout)
    self.engine = self.worker.engine
    self._rid: dict[int, int] = {}  # driver key -> engine request id
    self._key: dict[int, int] = {}  # engine request id -> driver key
    self._held: set[int] = set()  # engine ids submitted with hold_pages
    self._error: str | None = None  # a failed page write: the next step raises it
    return self.info()

  def info(self) -> dict:
    """What the driver needs to check requests and compatibility."""
    e = self.engine
    return dict(pid=os.getpid(), cfg=e.cfg, config=e.config, max_model_len=e.max_model_len,
                vocab_size=e.vocab_size, num_ranks=e.num_ranks, num_pages=e.allocator.num_pages,
                eos_ids=sorted(e.core.eos_ids), pool_segments=len(e.pool),
                devices=[str(d) for d in jax.devices()], process_index=jax.process_index(),
                process_count=jax.process_count())

  def submit(self, key: int, tokens, sampling, hold_pages: bool) -> None:
    self._track(key, self.engine.submit(tokens, sampling, hold_pages=hold_pages), hold_pages)

  def _track(self, key: int, rid: int, held: bool) -> None:
    self._rid[key], self._key[rid] = rid, key
    if held:
      self._held.add(rid)

  def abort(self, key: int) -> None:
    rid = self._rid.pop(key, None)
    if rid is not None:
      self.engine.abort(rid)
      self._key.pop(rid, None)
      self._held.discard(rid)

  def reserve_pages(self, num_tokens: int):
    return self.engine.reserve_pages(num_tokens)

  def release_pages(self, rank: int, pages) -> None:
    self.engine.release_pages(rank, pages)

  def read_pages(self, rank: int, pages):
    """-> (the pages' K/V as host arrays, their size in bytes)."""
    blob = jax.device_get(self.engine.read_pages(rank, pages))
    return blob, int(sum(a.nbytes for a in jax.tree.leaves(blob)))

  def transfer_address(self) -> str:
    """This process's jax transfer server (started now if not yet)."""
    if self._server is None:
      host = socket.gethostbyname(socket.gethostname())
      self._server = transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0",
                                                    [f"{host}:0"])
    return self._server.address()

  def offer_pages(self, rank: int, pages, uuid: int):
    """Offers the pages' K/V on the transfer server under uuid -> (their
    shapes and dtypes, their size in bytes)."""
    self.transfer_address()
    blob = self.engine.read_pages(rank, pages)
    self._server.await_pull(uuid, blob)
    meta = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blob)
    return meta, int(sum(a.nbytes for a in jax.tree.leaves(blob)))

  def pull_pages(self, rank: int, pages, address: str, uuid: int, boxed_meta) -> None:
    """Pulls pages another process offered (`offer_pages`) and writes them
    into a reservation."""
    import ray  # noqa: PLC0415 - only inside an actor
    try:
      meta = ray.get(boxed_meta[0], timeout=60)
      if address not in self._conns:
        self.transfer_address()
        self._conns[address] = self._server.connect(address)
      local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      spec = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=local), meta)
      blob = self._conns[address].pull(uuid, spec)
    except Exception as e:  # noqa: BLE001 - reported by the next step
      self._error = f"KV pages never arrived from {address}: {type(e).__name__}: {e}"
      return
    self.engine.write_pages(rank, pages, self.engine.place_pages(blob))

  def write_pages(self, rank: int, pages, boxed_ref) -> None:
    """Writes another process's `read_pages` (boxed_ref: [its ObjectRef],
    boxed so a lost object is this worker's error, not a lost call)."""
    import ray  # noqa: PLC0415 - only inside an actor
    try:
      blob = ray.get(boxed_ref[0], timeout=60)
    except Exception as e:  # noqa: BLE001 - reported by the next step
      self._error = f"KV pages never arrived from the prefill worker: {type(e).__name__}: {e}"
      return
    self.engine.write_pages(rank, pages, self.engine.place_pages(blob))

  def submit_prefilled(self, key: int, prompt, first_token: int, sampling, rank: int, pages,
                       drafts, arrival_s, first_token_s) -> None:
    drafts = None if drafts is None else self.engine.place_pages(drafts)
    rid = self.engine.submit_prefilled(prompt, first_token, sampling, rank, pages,
                                       arrival_s=arrival_s, first_token_s=first_token_s,
                                       drafts=drafts)
    self._track(key, rid, False)

  def step(self) -> dict:
    """One engine step (none without work) -> its events by driver key, the
    outputs of finished requests, held prefills' (rank, pages, drafts), the
    load and the prefix-page events."""
    if self._error:
      raise RuntimeError(self._error)
    events, outputs, held = [], {}, {}
    for rid, new, finished in self.worker.step():
      key = self._key.get(rid)
      if key is None:
        continue  # aborted by the driver after this step was dispatched
      events.append((key, new, finished))
      if finished:
        outputs[key] = self.engine.output(rid)
        if rid in self._held and outputs[key].finish_reason != "abort":
          rank, pages = self.engine.take_pages(rid)
          held[key] = (rank, pages, jax.device_get(self.engine.take_drafts(rid)))
        del self._rid[key], self._key[rid]
        self._held.discard(rid)
    return dict(events=events, outputs=outputs, held=held, load=self.worker.load(),
                kv_events=self.worker.take_events())

  def stats(self) -> dict:
    return self.engine.stats()

  def pid(self) -> int:
    return os.getpid()


def host_tree(params):
  """params as host numpy arrays (for `ray.put`)."""
  return jax.tree.map(np.asarray, params)
