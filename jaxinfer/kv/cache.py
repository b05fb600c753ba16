"""The paged KV cache on device: sizing, the zeroed pool, page transfer.

Device pool: a `kv.pool.PagePool` (one stacked entry per layer segment,
plus the MTP modules' entry when the engine speculates; its `PoolLayout`
says how the arrays are laid out), donated through every step. Page 0 is a
reserved null page. A pool of fp8 / int8 pages (`kv.pool.KV_CACHE_DTYPES`)
also holds its per-layer scales (`kv.scales`: from the params, or
calibrated by `engine.kv_calibration`). `gather_pages` /
`scatter_pages` move whole pages between engines (disaggregated serving).
The host side, which pages hold what, is `kv.allocator.PageAllocator`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.pool import NULL_PAGE, PagePool, PoolLayout  # noqa: F401 (NULL_PAGE: API)


def page_bytes(cfg: ModelConfig, page_size: int, dtype, mtp: bool = False) -> int:
  """Bytes of one page across all layers (and the MTP modules' with mtp),
  pages stored in `dtype` (fp8 / int8: 1 byte a value; the scales, a few
  bytes a layer for the whole pool, are not paged)."""
  per_token = sum(math.prod(e) for e in cfg.cache_entry_shapes().values())
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
  `engine.kv_calibration.resolve`) are required."""
  return PagePool.zeros(pool_layout(cfg, dtype), [n for _, _, n in cfg.segments()],
                        num_pages=num_pages, page_size=page_size,
                        entry=cfg.cache_entry_shapes(), dtype=dtype, sharding=sharding,
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
