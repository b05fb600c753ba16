"""The paged KV cache: a device page pool and its host allocator.

Device pool: a `page_pool.PagePool` (one stacked entry per layer segment,
plus the MTP modules' entry when the engine speculates; its `PoolLayout`
says how the arrays are laid out), donated through every step. Page 0 is a
reserved null page. A pool of fp8 / int8 pages (`page_pool.KV_CACHE_DTYPES`)
also holds its per-layer scales (`kv_scales` makes them).

Host `PageAllocator`: a free list, refcounts, and prefix caching: a full page
is identified by a hash chained on its parent's hash and its tokens, so equal
prefixes map to equal hash chains. Pages nobody references but whose content
is hashed stay cached, in LRU order, until an allocation needs them.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import cache_entry_shapes
from jaxinfer.page_pool import NULL_PAGE, PagePool, PoolLayout  # noqa: F401 (NULL_PAGE: API)


def page_bytes(cfg: ModelConfig, page_size: int, dtype, mtp: bool = False) -> int:
  """Bytes of one page across all layers (and the MTP modules' with mtp),
  pages stored in `dtype` (fp8 / int8: 1 byte a value; the scales, a few
  bytes a layer for the whole pool, are not paged)."""
  per_token = sum(math.prod(e) for e in cache_entry_shapes(cfg).values())
  layers = cfg.num_layers + (cfg.num_mtp_layers if mtp else 0)
  return per_token * page_size * layers * jnp.dtype(dtype).itemsize


def num_pages_for(cfg: ModelConfig, page_size: int, dtype, *, kv_cache_bytes: int | None = None,
                  memory_fraction: float = 0.5, device=None, mtp: bool = False) -> int:
  """Pages that fit a byte budget: kv_cache_bytes, or a fraction of the
  device's free memory (accelerators report it; CPU does not: pass bytes)."""
  if kv_cache_bytes is None:
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      raise ValueError("kv_cache_bytes is required on a device that does not report its memory "
                       f"({device.platform})")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    kv_cache_bytes = int(free * memory_fraction)
  per_page = page_bytes(cfg, page_size, dtype, mtp)
  n = kv_cache_bytes // per_page
  if n < 2:
    raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds {n} pages of "
                     f"{per_page} bytes; need at least 2 (page 0 is reserved)")
  return int(n)


def pool_layout(cfg: ModelConfig, dtype=None) -> PoolLayout:
  """The page pool's layout for this model's attention (pages in `dtype`)."""
  return PoolLayout.for_attention(cfg.attention, dtype)


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None,
              mtp: bool = False, scales=None) -> PagePool:
  """The zeroed device page pool: one stacked entry per `cfg.segments()`,
  plus (mtp) one for the MTP modules' own K/V, last. sharding: the
  Sharding of every paged array (`sharding.kv_pool_spec`), or None.
  dtype float8_e4m3fn / int8: a quantized pool, whose per-layer scales
  (per segment, the MTP entry last: {k_scale, v_scale} or {kv_scale} [L],
  `kv_scales.calibrate`) are required."""
  return PagePool.zeros(pool_layout(cfg, dtype), [n for _, _, n in cfg.segments()],
                        num_pages=num_pages, page_size=page_size,
                        entry=cache_entry_shapes(cfg), dtype=dtype, sharding=sharding,
                        mtp_layers=cfg.num_mtp_layers if mtp else 0, scales=scales)


@jax.jit
def gather_pages(pool: PagePool, pages) -> PagePool:
  """The pool's K/V at `pages` (global page ids [n]): a pool of n pages.
  A device op ordered before any later step on the pool."""
  return pool.take(pages)


@functools.partial(jax.jit, donate_argnames=("pool",))
def scatter_pages(pool: PagePool, pages, blob: PagePool) -> PagePool:
  """Writes `blob` (a `gather_pages` result of len(pages) pages, on the
  pool's devices) into the pool at `pages`. -> the new pool."""
  return pool.put(pages, blob)


def hash_page(parent: bytes | None, tokens, extra: bytes = b"") -> bytes:
  """Chained page hash: equal prefixes give equal chains (stable across
  processes). extra: more content of the page than its token ids (the
  content hashes of the images whose tokens it holds), b"" for text."""
  h = hashlib.blake2b(digest_size=16)
  h.update(parent or b"root")
  h.update(np.asarray(tokens, np.int32).tobytes())
  h.update(extra)
  return h.digest()


def page_extra(spans, page: int, page_size: int) -> bytes:
  """The hashes (bytes) of the spans (start, end, hash) overlapping a page."""
  lo, hi = page * page_size, (page + 1) * page_size
  return b"".join(h for s, e, h in spans if s < hi and e > lo)


def iter_page_hashes(tokens, page_size: int, spans=()):
  """The chained hashes of the full pages of `tokens`, lazily (callers that
  stop at the first miss hash no further). spans: (start, end, hash) of
  the images in the tokens (`page_extra`)."""
  parent = None
  for i in range(len(tokens) // page_size):
    parent = hash_page(parent, tokens[i * page_size:(i + 1) * page_size],
                       page_extra(spans, i, page_size) if spans else b"")
    yield parent


class PageAllocator:
  """Host bookkeeping of the page pool: free list, refcounts, prefix cache, LRU."""

  def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True):
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
    self.free: collections.deque[int] = collections.deque(range(1, num_pages))
    self.refcount = np.zeros(num_pages, np.int32)
    self.page_hash: dict[int, bytes] = {}
    self.hash_page: dict[bytes, int] = {}
    self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable
    self.events: list[tuple[str, bytes]] = []  # ("stored" | "evicted", hash) for routers

  @property
  def usable_pages(self) -> int:
    return self.num_pages - 1

  def num_available(self) -> int:
    """Pages an allocation can take now (free plus evictable cached)."""
    return len(self.free) + len(self.lru)

  def num_used(self) -> int:
    return int(np.count_nonzero(self.refcount))

  def num_cached(self) -> int:
    return len(self.page_hash)

  def allocate(self, n: int) -> list[int] | None:
    """n pages (refcount 1), evicting least recently used cached pages if
    needed; None (and nothing taken) if fewer than n are available."""
    if n > self.num_available():
      return None
    pages = []
    for _ in range(n):
      if self.free:
        page = self.free.popleft()
      else:
        page, _ = self.lru.popitem(last=False)
        self._forget(page)
      self.refcount[page] = 1
      pages.append(page)
    return pages

  def release(self, pages) -> None:
    """Drops one reference to each page; unreferenced pages become free, or
    evictable-cached if their content is hashed."""
    for page in pages:
      if page == NULL_PAGE:
        raise ValueError("cannot release the null page")
      if self.refcount[page] <= 0:
        raise ValueError(f"page {page} released more often than allocated")
      self.refcount[page] -= 1
      if self.refcount[page] == 0:
        if page in self.page_hash:
          self.lru[page] = None
        else:
          self.free.append(page)

  def match_prefix(self, tokens, max_pages: int, spans=()) -> tuple[list[int], list[bytes]]:
    """Longest run of cached full pages that prefixes `tokens` (at most
    max_pages; spans: the images in them, `iter_page_hashes`); takes a
    reference to each. -> (pages, their hashes)."""
    pages, hashes = [], []
    if not self.prefix_caching:
      return pages, hashes
    for h in iter_page_hashes(tokens[:max_pages * self.page_size], self.page_size, spans):
      page = self.hash_page.get(h)
      if page is None:
        break
      if self.refcount[page] == 0:
        self.lru.pop(page, None)
      self.refcount[page] += 1
      pages.append(page)
      hashes.append(h)
    return pages, hashes

  def register(self, page: int, h: bytes) -> None:
    """Marks a full, computed page as holding the content hashed `h`."""
    if not self.prefix_caching or page in self.page_hash or h in self.hash_page:
      return  # already cached (another page holds the same content)
    self.page_hash[page] = h
    self.hash_page[h] = page
    self.events.append(("stored", h))

  def forget_cached(self) -> None:
    """Empties the prefix cache (the pool's contents were lost): evictable
    pages become free, referenced ones stay their holders'."""
    for page in list(self.page_hash):
      self._forget(page)
    self.free.extend(self.lru)
    self.lru.clear()

  def _forget(self, page: int) -> None:
    h = self.page_hash.pop(page, None)
    if h is not None:
      del self.hash_page[h]
      self.events.append(("evicted", h))

  def check_consistency(self) -> None:
    """Invariants (used by tests): every page is exactly one of referenced,
    free, or evictable-cached."""
    free, lru = set(self.free), set(self.lru)
    referenced = {p for p in range(1, self.num_pages) if self.refcount[p] > 0}
    assert not free & lru and not free & referenced and not lru & referenced
    assert free | lru | referenced == set(range(1, self.num_pages)), "page leaked"
    assert lru <= set(self.page_hash)
