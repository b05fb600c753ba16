"""The simulated engine: the engine's own host core (`engine.core.HostCore`:
requests, one `Scheduler` + `PageAllocator` per attention-DP rank, the rank
choice, the K/V page hand-over, the padded step shapes), held as `core` and
stepped on the simulator's event clock. A step's duration comes from a cost
model (`sim/cost.py`); its sampled tokens are id 0 (requests end on max_tokens,
never on a stop token) and MTP acceptance is drawn per decode row from
per-position acceptance rates (P(accepted length > j), as `Engine.stats()`
reports them). A disaggregated prefill's K/V moves in whole pages and lands
`cost.kv_transfer_s(tokens)` after the prefill ends.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.engine.core import HostCore, forward, forward_attribute
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.scheduler import schedule_ranks
from jaxinfer.serving.worker import ROLES
from jaxinfer.sim.cost import StepShape, step_shape

# Token ids are not modelled: any non-negative id is accepted.
_ANY_TOKEN = 2 ** 31 - 1

RANK_POLICIES = ("tokens", "round_robin")

# TensorRT-LLM's DeepSeek-R1 acceptance lengths with 1, 2, 3 MTP drafts
# (1.92, 2.58, 2.82; serving_facts.md) as P(accepted length > j): 0.92,
# 2.58 - 1.92, 2.82 - 2.58.
TRTLLM_R1_ACCEPTANCE = (0.92, 0.66, 0.24)


def check_acceptance(acceptance, k: int = 0) -> tuple[float, ...]:
  """Per-position acceptance P(accepted length > j), j = 0.. (each in [0, 1],
  non-increasing: a draft is only accepted after the ones before it)."""
  acc = tuple(float(a) for a in acceptance)
  if any(not 0 <= a <= 1 for a in acc):
    raise ValueError(f"acceptance values must be in [0, 1], got {acc}")
  if any(b > a for a, b in zip(acc, acc[1:])):
    raise ValueError(f"acceptance must be non-increasing (P(accepted length > j)), got {acc}")
  if len(acc) < k:
    raise ValueError(f"acceptance gives {len(acc)} positions for {k} MTP draft tokens")
  return acc


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
  """One simulated instance: its engine limits, cost model and role.

  config: the EngineConfig of the engine being modelled (page_size,
    num_pages per rank (None: what the cost model's memory holds),
    max_num_seqs, max_num_batched_tokens, prefill_chunk_size, max_model_len,
    enable_prefix_caching, fixed_step_shapes, speculative).
  ranks: attention-DP ranks simulated, each its own Scheduler + PageAllocator.
  gpus_per_rank: GPUs one simulated rank stands for (per-GPU figures).
  acceptance: MTP per-position acceptance (with config.speculative).
  rank_policy: "tokens" (the engine's: least pending tokens + KV held) or
    "round_robin" (by request count: what attention-DP balance improves on).
  instance_ranks: the instance's attention-DP ranks (0: `ranks`, all
    simulated). The other instance_ranks - ranks are not simulated: each
    step, each of them takes the shape of a random recent step of a
    simulated rank (a bootstrap), so the instance's step waits for prefill
    chunks on any of its ranks, as a real attention-DP step does.
  """
  cost: object
  config: EngineConfig = EngineConfig()
  role: str = "mixed"
  ranks: int = 1
  gpus_per_rank: float = 1.0
  acceptance: tuple[float, ...] = ()
  rank_policy: str = "tokens"
  instance_ranks: int = 0
  name: str = ""

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"WorkerSpec: role must be one of {ROLES}, got {self.role!r}")
    if not isinstance(self.ranks, int) or self.ranks < 1:
      raise ValueError(f"WorkerSpec: ranks must be an int >= 1, got {self.ranks!r}")
    if not self.gpus_per_rank > 0:
      raise ValueError(f"WorkerSpec: gpus_per_rank must be > 0, got {self.gpus_per_rank}")
    if self.instance_ranks and self.instance_ranks < self.ranks:
      raise ValueError(f"WorkerSpec: instance_ranks ({self.instance_ranks}) must be >= ranks "
                       f"({self.ranks}), or 0")
    if self.rank_policy not in RANK_POLICIES:
      raise ValueError(f"WorkerSpec: rank_policy must be one of {RANK_POLICIES}, "
                       f"got {self.rank_policy!r}")
    if not isinstance(self.config, EngineConfig):
      raise TypeError(f"WorkerSpec: config must be an EngineConfig, got {type(self.config)}")
    spec = self.config.speculative
    object.__setattr__(self, "acceptance", check_acceptance(
        self.acceptance, spec.num_draft_tokens if spec is not None else 0))
    if not hasattr(self.cost, "step_time"):
      raise TypeError("WorkerSpec: cost must have step_time(shapes) (a jaxinfer.sim.cost model)")

  @property
  def gpus(self) -> float:
    return self.ranks * self.gpus_per_rank


@dataclasses.dataclass
class _Stats:
  steps: int = 0
  busy_s: float = 0.0
  parts: dict = dataclasses.field(default_factory=dict)
  # kind ("decode" | "mixed" | "prefill") -> [steps, seconds, decode seqs, prefill
  # tokens, mean and max over ranks of each rank's own work (cost.rank_seconds)]
  kinds: dict = dataclasses.field(default_factory=dict)
  decode_rows: int = 0  # sequence-steps that decoded
  decode_tokens: int = 0  # tokens those emitted (MTP: > decode_rows)
  transfer_s: float = 0.0  # K/V sent to decode workers (prefill side), summed


@dataclasses.dataclass(frozen=True)
class _KV:
  """The K/V a simulated prefill sends: only how long the copy takes."""
  seconds: float


class _Arrival:
  """A simulated copy in flight: ready once the clock reaches `ready_s`
  (`Transfer.ready` asks its blob's leaves `is_ready()`)."""

  def __init__(self, clock, ready_s: float):
    self.clock, self.ready_s = clock, ready_s

  def is_ready(self) -> bool:
    return self.clock() >= self.ready_s


class SimEngine:
  """An instance without devices: see the module docstring.

  clock() is the simulation time; wake_at(t) asks the simulator to poll the
  flow's transfers at time t (when a K/V copy lands)."""

  # The host API the serving flow calls, its host core's (as `Engine`'s).
  check_request, submit = forward("check_request"), forward("submit")
  output, abort, has_unfinished = forward("output"), forward("abort"), forward("has_unfinished")
  take_pages, take_drafts = forward("take_pages"), forward("take_drafts")
  reserve_pages, release_pages = forward("reserve_pages"), forward("release_pages")
  submit_prefilled = forward("submit_prefilled")
  config, max_model_len = forward_attribute("config"), forward_attribute("max_model_len")
  schedulers, allocators = forward_attribute("schedulers"), forward_attribute("allocators")

  def __init__(self, spec: WorkerSpec, *, clock, wake_at, name: str = ""):
    c = spec.config
    max_model_len = c.max_model_len or getattr(spec.cost, "max_model_len", None)
    if not max_model_len:
      raise ValueError(f"worker {name}: give EngineConfig.max_model_len (the cost model has no "
                       "model to take it from)")
    num_pages = c.num_pages or spec.cost.kv_pages(c.page_size)
    round_robin = spec.rank_policy == "round_robin"
    self.core = HostCore(c, num_ranks=spec.ranks, num_pages=num_pages, max_model_len=max_model_len,
                         vocab_size=_ANY_TOKEN, eos_ids=(),
                         pick_rank=self._round_robin if round_robin else None)
    self.spec, self.cost = spec, spec.cost
    self.clock, self._wake_at = clock, wake_at
    self.busy = False
    self._inflight = None  # (scheduled per rank, K)
    self._rr = -1
    self.shadows = max(0, spec.instance_ranks - spec.ranks)
    self._recent: collections.deque = collections.deque(maxlen=512)  # simulated rank shapes
    self.stats = _Stats()

  def _round_robin(self) -> int:
    """WorkerSpec.rank_policy "round_robin": the ranks in turn, by request count."""
    self._rr = (self._rr + 1) % self.core.num_ranks
    return self._rr

  # -- K/V hand-over (Transfer.start / land / cancel call these) ----------------

  def read_pages(self, rank: int, pages) -> _KV:
    seconds = self.cost.kv_transfer_s(len(pages) * self.core.config.page_size)
    self.stats.transfer_s += seconds
    return _KV(seconds)

  def place_pages(self, blob: _KV) -> _Arrival:
    ready_s = self.clock() + blob.seconds
    self._wake_at(ready_s)
    return _Arrival(self.clock, ready_s)

  def write_pages(self, rank: int, pages, blob) -> None:
    del rank, pages, blob  # no K/V is simulated

  # -- steps -------------------------------------------------------------------

  def dispatch(self, rng) -> float | None:
    """Schedules and 'dispatches' one step -> its duration (None: nothing to do)."""
    # The K the Engine's speculative runner takes for each rank's batch.
    core = self.core
    ks = [core.spec.draft_tokens_of(sch, core.config.max_num_seqs) if core.spec is not None else 0
          for sch in core.schedulers]
    K = max(ks)
    per_rank = schedule_ranks(core.schedulers, ks, core.config)
    if not any(per_rank):
      return None
    for sch, sched in zip(core.schedulers, per_rank):
      sch.on_dispatch(sched)
    shapes = [step_shape(sched, core=core, spec_k=k) for k, sched in zip(ks, per_rank)]
    everyone = shapes
    if self.shadows:
      self._recent.extend(shapes)
      pick = rng.integers(0, len(self._recent), self.shadows)
      everyone = shapes + [self._recent[i] for i in pick]
    cost = self.cost.step_time(everyone)
    self._record(shapes, everyone, cost)
    self._inflight = (per_rank, K)
    self.busy = True
    return cost.seconds

  def _record(self, shapes: list[StepShape], everyone: list[StepShape], cost) -> None:
    """shapes: the simulated ranks'; everyone: with the bootstrapped others.
    A step's kind is the instance's (mixed when any rank carries prefill:
    every rank waits for it); the per-rank counts are the simulated ranks'."""
    st = self.stats
    st.steps += 1
    st.busy_s += cost.seconds
    for k, v in cost.parts.items():
      st.parts[k] = st.parts.get(k, 0.0) + v
    pre = sum(s.prefill_tokens for s in shapes)
    dec = sum(s.decode_seqs for s in shapes)
    any_pre = pre or any(s.prefill_tokens for s in everyone)
    any_dec = dec or any(s.decode_seqs for s in everyone)
    kind = "prefill" if not any_dec else "mixed" if any_pre else "decode"
    work = cost.rank_seconds or [s.tokens for s in everyone]
    row = st.kinds.setdefault(kind, [0, 0.0, 0, 0, 0.0, 0.0])
    for i, v in enumerate((1, cost.seconds, dec, pre, sum(work) / len(work), max(work))):
      row[i] += v
    st.decode_rows += dec

  def complete(self, rng) -> list:
    """The step in flight ends -> (engine request id, new tokens, finished) events."""
    per_rank, K = self._inflight
    self._inflight, self.busy = None, False
    out = []
    for sch, sched in zip(self.core.schedulers, per_rank):
      if not sched:
        continue
      if self.core.spec is None:
        events = sch.apply(sched, [0] * len(sched))
      else:
        acc = self.spec.acceptance
        u = rng.random(len(sched))
        # One uniform per row: accepted = #{j < drafts: u < P(length > j)}
        # gives P(accepted > j) exactly, and the drafts stop at the first miss.
        emitted = [1 + sum(1 for j in range(s.num_draft) if x < acc[j]) if s.samples else 1
                   for s, x in zip(sched, u)]
        for s, n in zip(sched, emitted):  # decode rows, as step_shape counts them
          if s.samples and s.num_tokens - s.num_draft == 1 and s.start >= len(s.request.prompt):
            self.stats.decode_tokens += n
        events = sch.apply(sched, [[0] * (K + 1)] * len(sched), emitted, K)
      out += events
    if self.core.spec is None:
      self.stats.decode_tokens = self.stats.decode_rows
    return out
