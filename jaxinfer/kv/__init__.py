"""The paged KV cache, in one place.

  pool.py       the device page pool's type and layout (`PagePool`,
                `PoolLayout`), fp8 / int8 page storage
  contexts.py   how a forward sees its cache: `FullContext` (none),
                `ContiguousContext`, `PagedContext` (the engine's page pool)
  cache.py      the pool's size in bytes and pages, the zeroed pool, page
                transfer between engines (`gather_pages` / `scatter_pages`)
  allocator.py  host bookkeeping: free list, refcounts, prefix-cache hashes, LRU
  scales.py     fp8 / int8 pages' per-layer scales: names, those the params
                carry, scales from an amax (the calibrating forward is
                `engine.kv_calibration`'s: it runs the model)

Floors (docs/design.md's layers table, tests/repo/test_imports.py): pool and
contexts sit below the models (their attention blocks hand new entries to a
context; `ops` only names the kernels' axes the pool lays out), cache,
allocator and scales above them, below the engine; none of them imports a
model. This package's `__init__` imports none of them.
"""
