"""The driver's side of a worker actor: `RemoteEngine` is the engine host
API that `flow.Flow` calls (see flow.py), over a `ray_worker.WorkerProcess`
actor; `RemoteWorker` is the worker the flow routes to.

Calls that need no answer (submit, abort, page releases and writes) are sent
without waiting: Ray runs one caller's calls to an actor in order, so they
land before the actor's next step. Requests are checked in the driver with
the engine's own checks (a `HostCore` sized like the worker's), so a
submission the driver accepts is one the engine accepts. Finished requests'
outputs and held prefill pages come back with the step that finished them.
Only `reserve_pages` waits for an answer.
"""

from __future__ import annotations

import uuid

from jaxinfer.engine.core import HostCore
from jaxinfer.serving.ray_worker import WorkerSpec
from jaxinfer.serving.worker import EngineWorker


def ray_module():
  """The ray package (an optional dependency), imported on first use."""
  try:
    import ray  # noqa: PLC0415 - optional: `import jaxinfer.serving.cluster` must not need it
  except ImportError as e:
    raise ImportError("Cluster(backend='ray') needs ray: pip install 'jaxinfer[ray]'") from e
  return ray


class RemoteBlob:
  """K/V pages on their way to a decode worker (a leaf for `Transfer.ready`):
  in Ray's object store (ref: the pages) or offered on the prefill
  process's jax transfer server (ref: their shapes; address, uuid). Ready
  once the prefill process has put or offered them; offered pages die with
  their process (source.dead), and are then never ready: the transfer
  times out and the request is retried."""

  def __init__(self, ref, size_ref, source=None, address: str | None = None,
               uuid: int | None = None):
    self.ref, self.size_ref, self.source = ref, size_ref, source
    self.address, self.uuid = address, uuid

  def is_ready(self) -> bool:
    if self.uuid is not None and self.source.dead:
      return False
    ray = ray_module()
    done, _ = ray.wait([self.size_ref], timeout=0)
    if not done:
      return False
    try:
      ray.get(self.size_ref, timeout=0)
    except Exception:  # noqa: BLE001 - lost with its process: never ready, times out
      return False
    return True


class HostDrafts:
  """MTP drafts (host arrays, small) travelling with a step's answer."""

  def __init__(self, value):
    self.value = value

  def is_ready(self) -> bool:
    return True


class RemoteEngine:
  """The engine host API (`flow.py`) of a worker actor, in the driver."""

  def __init__(self, actor, info: dict, call_timeout_s: float):
    """info: the actor's `info()`, with its jax transfer server's address as
    "transfer_address" when pages travel by jax's transfer library."""
    self.actor, self.info, self.call_timeout_s = actor, info, call_timeout_s
    self.cfg, self.config, self.max_model_len = info["cfg"], info["config"], info["max_model_len"]
    self.vocab_size = info["vocab_size"]
    self.pool = range(info["pool_segments"])  # its length is what `check_compatible` reads
    # The engine's request checks, without its devices.
    self.core = HostCore(info["config"], num_ranks=info["num_ranks"], num_pages=info["num_pages"],
                         max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
                         eos_ids=info["eos_ids"])
    self.dead: str | None = None
    self._next = 0
    self._outputs: dict[int, object] = {}
    self._held: dict[int, tuple] = {}

  def check_request(self, prompt, sampling):
    return self.core.check_request(prompt, sampling)

  def submit(self, tokens, sampling=None, *, hold_pages: bool = False) -> int:
    tokens, sampling = self.core.check_request(tokens, sampling)  # what the engine checks
    key = self._next
    self._next += 1
    self.actor.submit.remote(key, tokens, sampling, hold_pages)
    return key

  def submit_prefilled(self, prompt, first_token, sampling, rank, pages, *, arrival_s=None,
                       first_token_s=None, drafts=None) -> int:
    key = self._next
    self._next += 1
    self.actor.submit_prefilled.remote(key, list(prompt), int(first_token), sampling, rank,
                                       list(pages), None if drafts is None else drafts.value,
                                       arrival_s, first_token_s)
    return key

  def abort(self, key: int) -> None:
    self.actor.abort.remote(key)
    self._outputs.pop(key, None)

  def output(self, key: int):
    return self._outputs.pop(key)

  def reserve_pages(self, num_tokens: int):
    if self.dead:
      return None
    try:
      return ray_module().get(self.actor.reserve_pages.remote(num_tokens), timeout=self.call_timeout_s)
    except Exception as e:  # noqa: BLE001 - dead or hung: the cluster's next step stops it
      self.dead = f"reserve_pages failed: {type(e).__name__}: {e}"
      return None

  def release_pages(self, rank: int, pages) -> None:
    self.actor.release_pages.remote(rank, list(pages))

  def take_pages(self, key: int):
    rank, pages, _ = self._held[key]
    return rank, pages

  def take_drafts(self, key: int):
    drafts = self._held.pop(key)[2]
    return None if drafts is None else HostDrafts(drafts)

  def read_pages(self, rank: int, pages) -> RemoteBlob:
    address = self.info.get("transfer_address")
    if address is None:
      return RemoteBlob(*self.actor.read_pages.options(num_returns=2).remote(rank, list(pages)))
    key = uuid.uuid4().int >> 66  # unique on this server across clusters (`fresh`)
    refs = self.actor.offer_pages.options(num_returns=2).remote(rank, list(pages), key)
    return RemoteBlob(*refs, source=self, address=address, uuid=key)

  def place_pages(self, blob):
    return blob  # in the object store (pages) or in the driver (drafts) until it lands

  def write_pages(self, rank: int, pages, blob: RemoteBlob) -> None:
    if blob.uuid is None:
      self.actor.write_pages.remote(rank, list(pages), [blob.ref])
    else:
      self.actor.pull_pages.remote(rank, list(pages), blob.address, blob.uuid, [blob.ref])

  def stats(self) -> dict:
    """The engine's `stats()` (waits for the answer; {} from a dead worker)."""
    try:
      return ray_module().get(self.actor.stats.remote(), timeout=self.call_timeout_s)
    except Exception:  # noqa: BLE001 - the cluster's next step stops it
      return {}

  def release_untaken(self) -> None:
    """After the flow read a step: frees held pages it did not take and drops
    outputs it did not read (their requests had moved on)."""
    for rank, pages, _ in self._held.values():
      self.release_pages(rank, pages)
    self._held.clear()
    self._outputs.clear()


class RemoteWorker(EngineWorker):
  """A worker actor as the flow sees it: a `RemoteEngine` with a role."""

  def __init__(self, actor, info: dict, spec: WorkerSpec, call_timeout_s: float):
    super().__init__(RemoteEngine(actor, info, call_timeout_s), role=spec.role,
                     name=spec.name or spec.role)
    self.pid = info["pid"]
    self._load = dict(active_prefill_tokens=0, decode_pages=0)
    self._kv_events: list = []

  def has_work(self) -> bool:
    return self.alive

  def absorb(self, result: dict) -> list:
    """A step's answer -> the engine events (outputs and held pages cached)."""
    self.engine._outputs.update(result["outputs"])
    self.engine._held.update(result["held"])
    self._load, self._kv_events = result["load"], result["kv_events"]
    return result["events"]

  def load(self) -> dict:
    return self._load

  def take_events(self) -> list:
    events, self._kv_events = self._kv_events, []
    return events

  def __repr__(self) -> str:
    return f"RemoteWorker({self.name!r}, role={self.role}, pid={self.pid})"
