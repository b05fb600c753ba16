"""The page pool: the engine's device KV cache, as one type.

`PagePool` holds one stacked entry per layer segment of the model
(`ModelConfig.segments()`), plus the MTP modules' own entry last when the
engine speculates. Its `PoolLayout` is the one place that knows how the
arrays are laid out:

  GQA  {k [L, K, P, ps, Hk], v [L, K, P, ps, Hv]}  per layer: the kernels' [K, P, ps, H]
  MLA  {kv [L, P, ps, C]}                        C = latent R + rope Hr, one head for K and V

(L layers of the segment, K KV heads, P pages, ps tokens per page.) Page 0 is
a reserved null page: padded page-table slots and padding tokens point at
it, and nothing valid is ever read from it.

Quantized KV (`KV_CACHE_DTYPES`: the pages in float8_e4m3fn or int8) adds
one float32 scale per layer and array, in the same entry: GQA
{k_scale, v_scale [L]}, MLA {kv_scale [L]} (one scale for the whole latent
row). Writes store `quantize(x, scale)` (fp8: clip(x / scale, +-448); int8:
round(clip(x / scale, +-127))); reads are q * scale, per tile in the kernels.
The scales are arrays of the pool (traced step arguments, never constants),
replicated, not paged: `take` / `put` move pages only.

Everything that touches the pool goes through the layout: `kv.cache`
allocates and moves pages with it, `sharding` places it, the paged KV
contexts write and read it, and `ops` hands its per-layer views to the
kernels (`ops.kernel_dims` names their axes, `ops.KERNEL_AXES`). It sits
with the contexts, below the models, so all of them can import it.
"""

from __future__ import annotations

import dataclasses

from flax import struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.config import Attention
from jaxinfer.ops import KERNEL_AXES

NULL_PAGE = 0
# EngineConfig.kv_cache_dtype -> (storage dtype, largest stored magnitude).
KV_CACHE_DTYPES = {"fp8": (jnp.float8_e4m3fn, 448.0), "int8": (jnp.int8, 127.0)}


def quant_kind(dtype) -> str | None:
  """The `KV_CACHE_DTYPES` name of a storage dtype, or None (unquantized)."""
  for kind, (stored, _) in KV_CACHE_DTYPES.items():
    if jnp.dtype(dtype) == jnp.dtype(stored):
      return kind
  return None


def quantize(x, scale, dtype):
  """x -> its stored form in `dtype`: fp8 clip(x / scale, -448, 448) in
  e4m3, int8 round(clip(x / scale, -127, 127)); an unquantized dtype: a cast."""
  kind = quant_kind(dtype)
  if kind is None:
    return x.astype(dtype)
  top = KV_CACHE_DTYPES[kind][1]
  y = jnp.clip(x.astype(jnp.float32) / scale, -top, top)
  return (jnp.round(y) if kind == "int8" else y).astype(dtype)


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """How a segment's stacked pool arrays are laid out (static, hashable).

  latent: MLA's one compressed entry `kv` [L, P, ps, C], whose first
  `latent_dim` columns are also the values; otherwise GQA's `k` and `v`
  [L, K, P, ps, H]. quantized: the pages are fp8 / int8 and the entry holds
  a float32 scale [L] per array (`scale_names`).
  """

  latent: bool
  quantized: bool = False

  @classmethod
  def for_attention(cls, attention: Attention | str, dtype=None) -> "PoolLayout":
    """The layout of `ModelConfig.attention` (an `Attention`, or its name)
    for pages of `dtype`."""
    if attention not in tuple(Attention):
      raise ValueError(f"PoolLayout: unknown attention kind {attention!r}")
    return cls(latent=Attention(attention).latent,
               quantized=quant_kind(dtype or jnp.float32) is not None)

  @classmethod
  def of(cls, latent: bool, stack: dict) -> "PoolLayout":
    """The layout of a segment's entry (quantized: its pages' dtype says)."""
    first = stack["kv" if latent else "k"]
    return cls(latent=latent, quantized=quant_kind(first.dtype) is not None)

  @property
  def names(self) -> tuple[str, ...]:
    """The paged arrays."""
    return ("kv",) if self.latent else ("k", "v")

  @property
  def scale_names(self) -> tuple[str, ...]:
    """The per-layer scale arrays [L] (quantized pools only)."""
    return tuple(f"{n}_scale" for n in self.names) if self.quantized else ()

  @property
  def axes(self) -> tuple[str, ...]:
    """Axis names of a stacked array (layer first)."""
    return ("layer", "page", "slot", "dim") if self.latent else ("layer", *KERNEL_AXES)

  def axis(self, name: str) -> int:
    return self.axes.index(name)

  def shape(self, layers: int, num_pages: int, page_size: int, entry: tuple) -> tuple:
    """A stacked array's shape from the per-token entry shape ((K, H) or (C,))."""
    if self.latent:
      return (layers, num_pages, page_size, *entry)
    kv_heads, dim = entry
    return (layers, kv_heads, num_pages, page_size, dim)

  def spec(self, *, pages=None, heads=None) -> P:
    """PartitionSpec of a stacked array: pages split over `pages` (attention
    DP ranks), KV heads over `heads` (GQA; MLA's one latent head is
    replicated), the rest replicated."""
    dims = {"page": pages, "kv_head": None if self.latent else heads}
    spec = [dims.get(a) for a in self.axes]
    while spec and spec[-1] is None:
      spec.pop()
    return P(*spec)

  def specs(self, **axes) -> dict[str, P]:
    """`spec` for every array of a segment's entry (scales replicated)."""
    return {**{n: self.spec(**axes) for n in self.names}, **{n: P() for n in self.scale_names}}

  def page_size(self, stack: dict) -> int:
    return stack[self.names[0]].shape[self.axis("slot")]

  def num_pages(self, stack: dict) -> int:
    return stack[self.names[0]].shape[self.axis("page")]

  def write(self, stack: dict, layer, page, slot, new: dict) -> dict:
    """Writes tokens' entries (new: GQA {k, v [T, K, H]}, MLA {kv [T, C]})
    at (page[t], slot[t]) of `layer`, in place under jit (quantized with
    the layer's scales in a quantized pool). One token is written as a
    dynamic-update-slice: XLA rewrites a one-row scatter so too, but then
    reads the old entry to keep it where the index could fall outside (a
    launch more a step and layer in the compiled H100 decode step); the
    pages given are the pool's own."""
    at = (layer, page, slot) if self.latent else (layer, slice(None), page, slot)
    scales = self.layer_scales(stack, layer)
    out = dict(stack)
    for n, scale in zip(self.names, scales):
      value = quantize(new[n], scale, stack[n].dtype)
      if page.shape[0] == 1:
        zero = jnp.zeros((), jnp.int32)
        if self.latent:  # [L, P, ps, C] <- [1, C]
          start, update = (layer, page[0], slot[0], zero), value[:, None, None]
        else:  # [L, K, P, ps, H] <- [1, K, H]
          start, update = (layer, zero, page[0], slot[0], zero), value[:, :, None, None]
        start = tuple(jnp.asarray(i, jnp.int32) for i in start)
        out[n] = jax.lax.dynamic_update_slice(stack[n], update, start)
      else:
        out[n] = stack[n].at[at].set(value)
    return out

  def layer_scales(self, stack: dict, layer) -> tuple:
    """Each paged array's scale at `layer` (scalars), or Nones (unquantized)."""
    if not self.quantized:
      return (None,) * len(self.names)
    return tuple(stack[n][layer] for n in self.scale_names)

  def kernel_pools(self, stack: dict):
    """(k_pages, v_pages) for `ops.ragged_paged_attention` with `layer=`:
    [L, K, P, ps, H] each; MLA: its latent pool as one KV head, and None for
    the values (the first latent_dim columns of the keys)."""
    if self.latent:
      return stack["kv"][:, None], None
    return stack["k"], stack["v"]

  def take(self, stack: dict, pages) -> dict:
    """Every layer's K/V at `pages` [n] (global ids): the entry with n pages
    (stored values: a quantized pool's pages are only meaningful with its scales)."""
    return {n: jnp.take(stack[n], pages, axis=self.axis("page")) for n in self.names}

  def put(self, stack: dict, pages, blob: dict) -> dict:
    """Writes a `take` result of len(pages) pages back at `pages`."""
    index = (slice(None),) * self.axis("page")
    for n in self.names:
      if self.quantized and blob[n].dtype != stack[n].dtype:
        raise ValueError(f"PoolLayout.put: blob {n!r} is {blob[n].dtype}, the quantized pool "
                         f"{stack[n].dtype} (pages move between pools of one kv_cache_dtype)")
    return {**stack, **{n: stack[n].at[index + (pages,)].set(blob[n].astype(stack[n].dtype))
                        for n in self.names}}


def _per_segment(scales, count: int):
  if scales is None or len(scales) != count:
    raise ValueError(f"PagePool: a quantized pool needs scales for each of its {count} "
                     f"segments, got {None if scales is None else len(scales)}")
  return scales


def _check_scales(scales: dict, layout: PoolLayout, layers: int, segment: int) -> dict:
  """A segment's scales as float32 [layers] arrays (ValueError naming a bad one)."""
  out = {}
  for n in layout.scale_names:
    a = scales.get(n) if isinstance(scales, dict) else None
    if a is None:
      raise ValueError(f"PagePool: scales[{segment}] lacks {n!r} (a quantized pool's "
                       f"scales: {layout.scale_names})")
    a = jnp.array(a, jnp.float32, copy=True)  # the pool is donated: never the caller's buffer
    if a.shape != (layers,):
      raise ValueError(f"PagePool: scales[{segment}][{n!r}] must be float32 [{layers}], "
                       f"got shape {a.shape}")
    out[n] = a
  return out


@struct.dataclass
class PagePool:
  """The device page pool: one stacked entry per layer segment (`segments`),
  the MTP modules' entry last when `mtp`. A pytree (jitted steps donate it)
  that also reads as the tuple of its segments (`pool[i]`, `len(pool)`).
  """

  segments: tuple
  layout: PoolLayout = struct.field(pytree_node=False)
  mtp: bool = struct.field(pytree_node=False, default=False)

  @classmethod
  def zeros(cls, layout: PoolLayout, segment_layers, *, num_pages: int, page_size: int,
            entry: dict, dtype, sharding=None, mtp_layers: int = 0,
            scales=None) -> "PagePool":
    """A zeroed pool: `segment_layers` layers per segment, plus mtp_layers
    for the MTP entry (0: none). sharding: a Sharding for every paged array
    (scales: replicated on its mesh), or None. scales (quantized layouts):
    per segment (the MTP entry last) {scale name: [layers] float32}."""
    def zeros(shape):
      if sharding is None:
        return jnp.zeros(shape, dtype)
      return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    counts = list(segment_layers) + ([mtp_layers] if mtp_layers else [])
    segments = [{n: zeros(layout.shape(layers, num_pages, page_size, entry[n]))
                 for n in layout.names} for layers in counts]
    if layout.quantized:
      segments = [{**seg, **_check_scales(seg_scales, layout, layers, i)}
                  for i, (seg, seg_scales, layers) in enumerate(
                      zip(segments, _per_segment(scales, len(counts)), counts))]
    pool = cls(tuple(segments), layout, mtp=bool(mtp_layers))
    return pool if sharding is None else jax.device_put(pool, pool.shardings(sharding))

  @property
  def scales(self) -> tuple:
    """Per segment {scale name: [L] float32} (quantized pools; else empty dicts)."""
    return tuple({n: seg[n] for n in self.layout.scale_names} for seg in self.segments)

  def shardings(self, sharding) -> "PagePool":
    """A Sharding per array: the paged ones on `sharding`, the scales
    replicated on its mesh (a single-device sharding serves both)."""
    mesh = getattr(sharding, "mesh", None)
    rep = jax.sharding.NamedSharding(mesh, P()) if mesh is not None else sharding
    return self.replace(segments=tuple({n: sharding if n in self.layout.names else rep
                                        for n in seg} for seg in self.segments))

  def __len__(self) -> int:
    return len(self.segments)

  def __getitem__(self, i):
    return self.segments[i]

  @property
  def model(self) -> tuple:
    """The model's segment entries (the MTP entry left out)."""
    return self.segments[:-1] if self.mtp else self.segments

  @property
  def mtp_entry(self) -> dict:
    if not self.mtp:
      raise ValueError("PagePool: this pool holds no MTP entry")
    return self.segments[-1]

  def with_segments(self, model, mtp_entry=None) -> "PagePool":
    """The same pool over new arrays (a step's outputs)."""
    segments = tuple(model) + ((mtp_entry,) if self.mtp else ())
    if self.mtp and mtp_entry is None:
      raise ValueError("PagePool.with_segments: this pool needs its MTP entry")
    return self.replace(segments=segments)

  @property
  def page_size(self) -> int:
    return self.layout.page_size(self.segments[0])

  @property
  def num_pages(self) -> int:
    return self.layout.num_pages(self.segments[0])

  def take(self, pages) -> "PagePool":
    """Every segment's K/V at `pages` (global page ids [n])."""
    return self.replace(segments=tuple(self.layout.take(s, pages) for s in self.segments))

  def put(self, pages, blob: "PagePool") -> "PagePool":
    """Writes `blob` (a `take` result of len(pages) pages) at `pages`."""
    if len(blob) != len(self):
      raise ValueError(f"PagePool.put: blob has {len(blob)} segments, the pool {len(self)}")
    return self.replace(segments=tuple(self.layout.put(s, pages, b)
                                       for s, b in zip(self.segments, blob.segments)))

  def spec(self, **axes) -> "PagePool":
    """The pool's PartitionSpecs (a PagePool of them; `PoolLayout.spec` axes)."""
    return self.replace(segments=tuple(self.layout.specs(**axes) for _ in self.segments))
