"""A KV-aware request router over data-parallel workers (NVIDIA Dynamo style).

Each worker's `PageAllocator` emits ("stored" | "evicted", hash) events for
its prefix-cached pages; hashes are chained (`kv.allocator.hash_page`), so a
request's leading pages that a worker holds are exactly the prefix it need
not recompute there. Workers also report their load: prompt tokens still to
prefill and KV pages in use.

The "kv" policy weighs both, as Dynamo's KV router does, in units of pages:

  cost(w) = prefill_load_scale * max(0, (prefill_w + ISL) / page_size
                                        - overlap_credit * overlap_w)
            + decode_w

prefill_w + ISL is the prompt work queued on w once this request joins it,
less the pages w already holds; decode_w is the KV memory w is already
carrying, a proxy for its decode step time.

Reports lag the routing decisions. A router that only trusts the last report
sends a whole burst to the worker that looked idle a moment ago (the herding
Dynamo issues 7836 and 589 describe), so `pick` counts each routed request's
load on its worker at once, and the worker's next load report, which includes
it, replaces that estimate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxinfer.kv.allocator import iter_page_hashes

POLICIES = ("kv", "round_robin", "random", "least_loaded")


@dataclasses.dataclass
class _Worker:
  """What the router knows of one worker."""
  hashes: set = dataclasses.field(default_factory=set)
  prefill: int = 0        # reported active prefill tokens
  decode: int = 0         # reported KV pages in use
  pend_prefill: int = 0   # routed since the last report
  pend_decode: int = 0
  routed: int = 0
  last_pick: int = -1     # pick number of its last request (tie-break: least recent first)
  alive: bool = True


class Router:
  """Chooses a worker per request; see the module docstring for the cost."""

  def __init__(self, num_workers: int, page_size: int, policy: str = "kv", *,
               prefill_load_scale: float = 1.0, overlap_credit: float = 1.0,
               temperature: float = 0.0, seed: int = 0):
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    if temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    if prefill_load_scale < 0:
      raise ValueError(f"prefill_load_scale must be >= 0, got {prefill_load_scale}")
    if overlap_credit < 0:
      raise ValueError(f"overlap_credit must be >= 0, got {overlap_credit}")
    self.page_size, self.policy = page_size, policy
    self.prefill_load_scale, self.overlap_credit = prefill_load_scale, overlap_credit
    self.temperature = temperature
    self._rng = np.random.default_rng(seed)
    self._workers = [_Worker() for _ in range(num_workers)]
    self._last_rr = -1  # round_robin: the index picked last
    self._picks = self._overlap_pages = self._overlap_tokens = self._prompt_tokens = 0

  @property
  def num_workers(self) -> int:
    """Workers ever known, removed ones included (indices are never reused)."""
    return len(self._workers)

  def alive(self) -> list[int]:
    return [i for i, w in enumerate(self._workers) if w.alive]

  def _check_worker(self, worker: int) -> _Worker:
    if not 0 <= worker < len(self._workers):
      raise ValueError(f"worker {worker} out of range [0, {len(self._workers)})")
    return self._workers[worker]

  # -- worker side ----------------------------------------------------------

  def report(self, worker: int, *, events=(), active_prefill_tokens: int | None = None,
             decode_pages: int | None = None) -> None:
    """A worker's report: applies its hash events; load figures, when given,
    replace the last ones and clear the load counted for requests routed to it
    since (the report includes them). Each figure clears only its own pending
    term, so a worker may report the two at different times. A removed
    worker's late reports are dropped: it is never picked again anyway."""
    w = self._check_worker(worker)
    if not w.alive:
      return
    for event in events:
      kind, h = event
      if not isinstance(h, bytes):
        raise TypeError(f"event hash must be bytes, got {type(h).__name__}")
      if kind == "stored":
        w.hashes.add(h)
      elif kind == "evicted":
        w.hashes.discard(h)
      else:
        raise ValueError(f"event kind must be 'stored' or 'evicted', got {kind!r}")
    if active_prefill_tokens is not None:
      if active_prefill_tokens < 0:
        raise ValueError(f"active_prefill_tokens must be >= 0, got {active_prefill_tokens}")
      w.prefill, w.pend_prefill = int(active_prefill_tokens), 0
    if decode_pages is not None:
      if decode_pages < 0:
        raise ValueError(f"decode_pages must be >= 0, got {decode_pages}")
      w.decode, w.pend_decode = int(decode_pages), 0

  def remove_worker(self, worker: int) -> None:
    """A dead worker: forgotten and never picked again."""
    w = self._check_worker(worker)
    self._workers[worker] = _Worker(routed=w.routed, alive=False)

  def add_worker(self) -> int:
    """A new, empty worker; returns its index."""
    self._workers.append(_Worker())
    return len(self._workers) - 1

  # -- request side ---------------------------------------------------------

  def page_hashes(self, tokens) -> list[bytes]:
    """Chained hashes of the request's full pages (a partial last page is
    never cached, so it never matches)."""
    return list(iter_page_hashes(np.asarray(tokens, np.int32), self.page_size))

  def overlap(self, worker: int, tokens, hashes=None) -> int:
    """Leading pages of the request that `worker` holds (stops at the first
    miss: a page past a miss cannot be reused, its K/V depends on the miss)."""
    held = self._check_worker(worker).hashes
    n = 0
    hashes = iter_page_hashes(np.asarray(tokens, np.int32), self.page_size) \
        if hashes is None else hashes
    for h in hashes:
      if h not in held:
        break
      n += 1
    return n

  def _load(self, w: _Worker) -> float:
    """Pages of work: prompt tokens to prefill (in pages) plus pages held."""
    return (w.prefill + w.pend_prefill) / self.page_size + w.decode + w.pend_decode

  def _tie(self, i: int) -> tuple:
    w = self._workers[i]
    return self._load(w), w.last_pick, i

  def _candidates(self, candidates) -> list[int]:
    if candidates is None:
      out = self.alive()
      if not out:
        raise ValueError("no workers to pick from: all workers were removed")
      return out
    out = list(candidates)
    if not out:
      raise ValueError("candidates is empty")
    for c in out:
      if not self._check_worker(c).alive:
        raise ValueError(f"candidate worker {c} was removed")
    return out

  def _costs(self, isl: int, overlaps: dict[int, int]) -> dict[int, float]:
    out = {}
    for c, ov in overlaps.items():
      w = self._workers[c]
      prefill = (w.prefill + w.pend_prefill + isl) / self.page_size - self.overlap_credit * ov
      out[c] = self.prefill_load_scale * max(0.0, prefill) + w.decode + w.pend_decode
    return out

  def costs(self, tokens, candidates) -> dict[int, float]:
    """The kv policy's cost of each candidate (pending load included)."""
    cands = self._candidates(candidates)
    hashes = self.page_hashes(tokens)
    return self._costs(len(tokens), {c: self.overlap(c, tokens, hashes) for c in cands})

  def pick(self, tokens, candidates=None, hashes=None) -> int:
    """Chooses a worker among `candidates` (default: all alive).

    kv: lowest cost (ties: lowest load, then the least recently picked, so
    idle equal workers take turns instead of the first one taking all); with temperature
    > 0, a sample from softmax(-cost' / temperature), cost' the costs min-max
    normalised to [0, 1], so the temperature means the same at any scale.
    round_robin: the next candidate after the last pick, cycling. random:
    uniform (seeded). least_loaded: lowest prefill_tokens/page_size +
    decode_pages, pending included.

    The request's load is then counted on the chosen worker at once (prompt
    tokens it must compute, pages it will hold), so a burst between two
    reports spreads instead of herding onto one worker. hashes: the
    request's `page_hashes`, when the caller has them already."""
    cands = self._candidates(candidates)
    isl, ps = len(tokens), self.page_size
    hashes = self.page_hashes(tokens) if hashes is None else hashes
    overlaps = {c: self.overlap(c, tokens, hashes) for c in cands}
    if self.policy == "kv":
      costs = self._costs(isl, overlaps)
      if self.temperature > 0:
        c = np.array([costs[i] for i in cands])
        span = c.max() - c.min()
        z = -((c - c.min()) / span if span > 0 else np.zeros_like(c)) / self.temperature
        p = np.exp(z - z.max())
        chosen = cands[int(self._rng.choice(len(cands), p=p / p.sum()))]
      else:
        chosen = min(cands, key=lambda i: (costs[i], *self._tie(i)))
    elif self.policy == "round_robin":
      after = [c for c in cands if c > self._last_rr]
      chosen = min(after) if after else min(cands)
      self._last_rr = chosen
    elif self.policy == "random":
      chosen = cands[int(self._rng.integers(len(cands)))]
    else:  # least_loaded
      chosen = min(cands, key=lambda i: self._tie(i))
    ov = overlaps[chosen]
    w = self._workers[chosen]
    w.pend_prefill += max(0, isl - ov * ps)
    w.pend_decode += max(0, math.ceil(isl / ps) - ov)
    w.routed += 1
    w.last_pick = self._picks
    self._picks += 1
    self._overlap_pages += ov
    self._overlap_tokens += ov * ps
    self._prompt_tokens += isl
    return chosen

  def stats(self) -> dict:
    """routed: requests per worker; mean_overlap_pages: per pick; hit_rate:
    prompt tokens found cached on the chosen worker over all prompt tokens."""
    picks = self._picks
    return {
        "routed": [w.routed for w in self._workers],
        "picks": picks,
        "mean_overlap_pages": self._overlap_pages / picks if picks else 0.0,
        "hit_rate": self._overlap_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
    }
