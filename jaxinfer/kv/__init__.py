"""The paged KV cache, in one place.

  pool.py       the device page pool's type and layout (`PagePool`,
                `PoolLayout`), fp8 / int8 page storage
  contexts.py   how a forward sees its cache: `FullContext` (none),
                `ContiguousContext`, `PagedContext` (the engine's page pool)
  cache.py      the pool's size in bytes and pages, the zeroed pool, page
                transfer between engines (`gather_pages` / `scatter_pages`)
  allocator.py  host bookkeeping: free list, refcounts, prefix-cache hashes, LRU
  scales.py     fp8 / int8 pages' per-layer scales: from a checkpoint or calibrated

Layers: pool sits with `ops` (the kernels read its layout), contexts with the
models (their attention blocks hand new entries to a context), cache,
allocator and scales above the models (sizes come from the attention config,
calibration runs the model). This package's `__init__` imports none of them.
"""
