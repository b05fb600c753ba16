"""Host bookkeeping of the page pool: which pages are free, who holds each,
and which hold a known prefix.

`PageAllocator`: a free list, refcounts, and prefix caching: a full page
is identified by a hash chained on its parent's hash and its tokens, so equal
prefixes map to equal hash chains. Pages nobody references but whose content
is hashed stay cached, in LRU order, until an allocation needs them.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxinfer.kv.pool import NULL_PAGE


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
