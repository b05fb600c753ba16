"""The one kernel dispatch. Model code calls these; it never branches on backend.

Each kernel op takes a static `Backend` (`jaxinfer.backend`), which models
pass from their config (`ModelConfig.backend`): `attention` picks the
kernels ("xla", "pallas", "mosaic", or None: Pallas for a GPU target, XLA
otherwise), `target` the device the program is built for ("gpu", "cpu", or
None: the process's default backend).

With a GPU target and attention None, a shape the GPU kernel cannot tile
(`paged_attention.tile_error`) runs the XLA path instead; an explicit
"pallas" raises the kernel's ValueError. GPU tiling of the paged kernel comes
from shapes alone (`paged_tiling`). "mosaic" sends decode-only paged steps to
the Mosaic GPU kernels where they take the shapes (`mosaic_decode_kernel`),
every other step to "pallas".

  causal_attention        full causal self-attention (prefill without a cache)
  full_attention          every query sees every key (diffusion transformers)
  attention               queries at arbitrary positions over a padded KV range (XLA)
  ragged_paged_attention  an engine step's mixed batch over the page pool
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer import xla_attention
from jaxinfer.backend import Backend
from jaxinfer.kv.pool import kernel_dims
import pallas_kernels
from pallas_kernels import mosaic_mla_attention as mosaic_mla
from pallas_kernels import mosaic_paged_attention as mosaic
from pallas_kernels.paged_attention import dequantize, gpu_blocks, tile_error
from pallas_kernels.ragged_paged_attention import to_padded

_BLOCK_Q, _BLOCK_K = 64, 128  # XLA attention blocks (queries, keys)
_SM_PROGRAMS = 132  # split-K below this many (sequence, KV head) programs (H100: 132 SMs)


def quantized_matmul(x, codes, scale, *, block, packed=None, scale2=None,
                     backend: Backend = Backend()):
  """x [M, K] @ W^T with W [N, K] = codes * scale (* scale2) over `block`
  blocks (codes float8_e4m3fn / int8, or uint8 two per byte with packed=
  "int4" / "e2m1"), on the Pallas kernel that dequantizes tile by tile
  (`pallas_kernels.quantized_matmul`): compiled for a GPU target, interpreted
  otherwise. -> [M, N] in x's dtype. (`layers.linear` picks it.)"""
  return pallas_kernels.quantized_matmul(x, codes, scale, block=block, packed=packed,
                                         scale2=scale2, interpret=not backend.on_gpu())


def quantized_grouped_matmul(xs, codes, scale, group_sizes, *, block, packed=None, scale2=None,
                             backend: Backend = Backend()):
  """`jax.lax.ragged_dot` of xs [R, K] (sorted by expert, group_sizes [E]) with
  the experts' W_e [N, K] = codes[e] * scale[e] (* scale2[e]), on the Pallas
  kernel that dequantizes tile by tile (compiled for a GPU target,
  interpreted otherwise). -> [R, N]. (`moe_core.grouped_ffn` picks it.)"""
  return pallas_kernels.quantized_grouped_matmul(xs, codes, scale, group_sizes, block=block,
                                                 packed=packed, scale2=scale2,
                                                 interpret=not backend.on_gpu())


def paged_tiling(num_seqs: int, num_kv_heads: int, pages_per_seq: int, page_size: int, *,
                 num_q_heads: int | None = None, max_q: int = 1, head_dim: int = 128,
                 value_dim: int | None = None, values_from_keys: bool = False,
                 quantized_kv: bool = False) -> dict:
  """GPU tiling of the paged kernel from static shapes (the kernel's keyword
  arguments): `pallas_kernels.paged_attention.gpu_blocks`, i.e. ~64 keys
  per loop step, split-K (up to 8) when sequences x KV heads x row blocks
  give fewer than ~2 programs per H100 SM and the split partials stay under
  5% of the KV bytes, 8 warps for MLA-wide values; quantized_kv (1-byte
  pages): the KV bytes at 1 a value, and one pipeline stage for MLA-wide
  values (shared memory)."""
  b = gpu_blocks(num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                 num_q_heads=num_q_heads or num_kv_heads, max_q=max_q,
                 pages_per_seq=pages_per_seq, page_size=page_size, head_dim=head_dim,
                 value_dim=value_dim or head_dim, values_from_keys=values_from_keys,
                 sms=_SM_PROGRAMS, quantized_kv=quantized_kv)
  return dataclasses.asdict(b)


def causal_attention(q, k, v, *, window=0, window_choices=(0,), sinks=None, scale,
                     backend: Backend = Backend()):
  """Causal self-attention: q [B, T, N, Hk], k [B, T, K, Hk], v [B, T, K, Hv].

  window may be traced (a scanned layer's); the Pallas kernel needs it static,
  so it then switches over `window_choices` (the model's distinct windows).
  The GPU kernel pads head dims to powers of two; below 16 (no tensor-core
  tile) attention None runs XLA.
  """
  impl, interpret = backend.attention_kernel()
  small = min(q.shape[-1], v.shape[-1]) < 16
  if impl == "xla" or (not interpret and small and backend.attention is None):
    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return _attention_xla(q, k, v, pos, jnp.full((B,), T, jnp.int32), window, sinks, scale)
  flash = lambda w: functools.partial(pallas_kernels.flash_attention, causal=True, sm_scale=scale,
                                      window=w, interpret=interpret)
  if isinstance(window, int):
    return flash(window)(q, k, v, sinks=sinks)
  if len(window_choices) == 1:
    return flash(window_choices[0])(q, k, v, sinks=sinks)
  index = jnp.argmax(jnp.asarray(window_choices, jnp.int32) == window)
  return jax.lax.switch(index, [lambda q, k, v, s, w=w: flash(w)(q, k, v, sinks=s)
                                for w in window_choices], q, k, v, sinks)


def full_attention(q, k, v, *, scale, backend: Backend = Backend()):
  """Unmasked attention: q [B, T, N, Hk], k [B, S, K, Hk], v [B, S, K, Hv]
  -> [B, T, N, Hv] in q's dtype (a video DiT's self- and cross-attention).

  GPU: the flash kernel without causality; XLA: every query placed after the
  last key (position S - 1), so the causal XLA form, blocked past one block,
  masks nothing. Head dims below 16 run XLA (as `causal_attention`)."""
  impl, interpret = backend.attention_kernel()
  small = min(q.shape[-1], v.shape[-1]) < 16
  if impl == "xla" or (not interpret and small and backend.attention is None):
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    pos = jnp.full((B, T), S - 1, jnp.int32)
    return _attention_xla(q, k, v, pos, jnp.full((B,), S, jnp.int32), 0, None, scale)
  return pallas_kernels.flash_attention(q, k, v, causal=False, sm_scale=scale,
                                        interpret=interpret)


def attention(q, k, v, *, q_positions, kv_lengths, window=0, sinks=None, scale):
  """Causal grouped-query attention over a (possibly padded) key range.

  q [B, T, N, Hk]; k [B, S, K, Hk]; v [B, S, K, Hv]; N % K == 0.
  q_positions [B, T] int32: absolute position of each query; key j sits at
  position j. Key j is visible to query t iff j < kv_lengths[b],
  j <= q_positions[b, t] and (window == 0 or q_positions - j < window)
  (HF's sliding-window rule). `window` may be a traced scalar (scanned layers).
  sinks [N] or None: a learned logit per head in the softmax denominator
  (GPT-OSS). Returns [B, T, N, Hv] in q's dtype (zeros for a row that sees no
  key); softmax runs in float32.
  Every backend runs this XLA form (it takes no `Backend`).
  """
  return _attention_xla(q, k, v, q_positions, kv_lengths, window, sinks, scale)


def _attention_xla(q, k, v, q_positions, kv_lengths, window, sinks, scale):
  # Past one block of queries and of keys, blocks with an online softmax: no
  # [T, S] scores, and key blocks past causality or the window are skipped
  # (bench_dense prefill @512 on a 2-core CPU: see `xla_attention`).
  if q.shape[1] > _BLOCK_Q and k.shape[1] > _BLOCK_K:
    return xla_attention.blocked(q, k, v, q_positions, kv_lengths, window, sinks, scale,
                                 block_q=_BLOCK_Q, block_k=_BLOCK_K)
  return xla_attention.dense(q, k, v, q_positions, kv_lengths, window, sinks, scale)


def ragged_paged_attention(q, k_pages, v_pages, *, kv_lens, page_table, cu_q_lens, max_q,
                           window=0, sinks=None, scale, v_head_dim=None, layer=None,
                           k_scale=None, v_scale=None, backend: Backend = Backend()):
  """Attention for a token-flattened mixed batch over a paged KV cache.

  q [T, N, Hk]: the step's tokens, sequence b owning rows
  cu_q_lens[b]:cu_q_lens[b + 1] (its newest tokens, the last at position
  kv_lens[b] - 1). k_pages [K, P, page_size, Hk], v_pages [K, P, page_size, Hv];
  page_table [B, pages_per_seq]; max_q (static) >= every sequence's query count.
  v_pages None: the values are the first v_head_dim columns of the keys (MLA's
  latent, one pool for both). layer: pools carry a leading layer axis
  ([L, K, P, page_size, H]) and this layer's pages are read (gathered
  directly, never slicing the layer's whole pool). Rows past cu_q_lens[-1] are padding and return
  zeros. -> [T, N, Hv]. k_scale / v_scale (float32 scalars, or None):
  quantized pages (fp8 / int8, `kv.pool.KV_CACHE_DTYPES`) read as
  pages * scale: per tile in the kernel, after the gather on the XLA path
  (MLA: k_scale, the latent's one scale).

  GPU target: the kernel tiled by `paged_tiling`, or (attention None)
  the XLA path where `tile_error` says the kernel cannot tile the shapes.
  "mosaic": decode-only steps (max_q 1) on `mosaic_paged_attention` (GQA)
  or `mosaic_mla_attention` (MLA's latent pool) where their `unsupported`
  finds nothing against the shapes; other steps "pallas".
  """
  impl, interpret = backend.attention_kernel()
  if impl == "mosaic":
    out = _mosaic_decode(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                         sinks, scale, v_head_dim, layer, k_scale, interpret)
    if out is not None:
      return out
    impl = "pallas"
  if impl == "pallas":
    tiling = {}
    if not interpret:
      dims = kernel_dims(k_pages)
      page_size = dims["slot"]
      dv = v_head_dim if v_pages is None else v_pages.shape[-1]
      tiling = paged_tiling(page_table.shape[0], dims["kv_head"], page_table.shape[1],
                            page_size, num_q_heads=q.shape[1], max_q=max_q,
                            head_dim=q.shape[-1], value_dim=dv, values_from_keys=v_pages is None,
                            quantized_kv=k_scale is not None)
      why = tile_error(q.shape[-1], dv, page_size, tiling["pages_per_compute_block"])
      if why and backend.attention is None:
        impl = "xla"
  if impl == "pallas":
    return pallas_kernels.ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q=max_q, sm_scale=scale,
        window=window, sinks=sinks, v_head_dim=v_head_dim, layer=layer, k_scale=k_scale,
        v_scale=v_scale, interpret=interpret, **tiling)
  if layer is None:
    k_pages = k_pages[None]
    v_pages = None if v_pages is None else v_pages[None]
    layer = 0
  return _ragged_paged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q,
                           window, sinks, scale, v_head_dim, layer, (k_scale, v_scale))


def _ragged_mosaic(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, window, sinks, scale,
                   layer, interpret):
  """A decode-only step (one token a sequence) on the Mosaic GPU kernel:
  tokens laid out per sequence, attended, and put back in token order."""
  q_pad, seq, row, valid = to_padded(q, cu_q_lens, 1)
  dims = kernel_dims(k_pages)
  splits = 1
  while (splits < 8 and page_table.shape[0] * dims["kv_head"] * splits < _SM_PROGRAMS
         and 2 * splits * mosaic.pages_per_block(dims["slot"]) <= page_table.shape[1]):
    splits *= 2
  out = mosaic.mosaic_paged_attention(q_pad, k_pages, v_pages, kv_lens, page_table,
                                      sm_scale=scale, window=window, sinks=sinks,
                                      num_splits=splits, layer=layer, interpret=interpret)
  return jnp.where(valid[:, None, None], out[seq, row], 0).astype(q.dtype)


def mosaic_decode_kernel(q_shape, dtype, k_pages_shape, *, values_dim=None, latent_dim=None,
                         max_q: int = 1, window=0, sinks: bool = False,
                         quantized: bool = False) -> tuple[str | None, str | None]:
  """Which Mosaic GPU kernel takes a paged step under
  `Backend(attention="mosaic")`: ("mla", None) for MLA's latent pool on
  `mosaic_mla_attention`, ("gqa", None) for GQA pages on
  `mosaic_paged_attention`, or (None, why) when neither does (the step then
  runs "pallas"). Only decode-only steps (max_q 1) qualify.

  q_shape [T, N, Hk] (the step's tokens); k_pages_shape [(L,) K, P,
  page_size, Hk]; values_dim: the value pages' head dim, or None for MLA's
  latent pool (keys and values in one pool, the values its first latent_dim
  columns); window: an int, or a traced one (a scanned layer's); sinks:
  the layer has attention sinks; quantized: fp8 / int8 pages. The MLA
  kernel takes no window, sinks or quantized pages."""
  if max_q != 1:
    return None, f"max_q {max_q} > 1: not a decode-only step"
  page_size = k_pages_shape[-2]  # [..., K, P, page_size, Hk]
  if values_dim is None:
    if not isinstance(window, int) or window or sinks or quantized:
      return None, "a window (or a traced one), sinks or quantized latent pages"
    bad = mosaic_mla.unsupported(q_shape[-1], latent_dim, page_size, dtype)
    return ("mla", None) if bad is None else (None, bad[1])
  bad = mosaic.unsupported((1, 1, *q_shape[1:]), dtype, k_pages_shape, quantized=quantized,
                           values_dim=values_dim)
  return ("gqa", None) if bad is None else (None, bad[1])


def _mosaic_decode(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window, sinks,
                   scale, v_head_dim, layer, k_scale, interpret):
  """The step on the Mosaic GPU kernel `mosaic_decode_kernel` picks, or None
  when it picks none."""
  kernel, _ = mosaic_decode_kernel(
      q.shape, q.dtype, k_pages.shape, values_dim=None if v_pages is None else v_pages.shape[-1],
      latent_dim=v_head_dim, max_q=max_q, window=window, sinks=sinks is not None,
      quantized=k_scale is not None)
  if kernel == "mla":
    return _ragged_mosaic_mla(q, k_pages, kv_lens, page_table, cu_q_lens, scale, v_head_dim,
                              layer, interpret)
  if kernel == "gqa":
    return _ragged_mosaic(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, window, sinks,
                          scale, layer, interpret)
  return None


def _ragged_mosaic_mla(q, k_pages, kv_lens, page_table, cu_q_lens, scale, latent_dim, layer,
                       interpret):
  """MLA's decode-only step on the Mosaic GPU kernel. The latent pool
  [(L,) 1, P, ps, R + Hr] is read as one run of pages ([L * P, ps, R + Hr],
  a free reshape) with this layer's page numbers offset by layer * P, so no
  layer's pool is sliced out."""
  q_pad, seq, row, valid = to_padded(q, cu_q_lens, 1)
  dims = kernel_dims(k_pages)
  pages = k_pages.reshape(-1, dims["slot"], k_pages.shape[-1])
  table = page_table if layer is None else page_table + layer * dims["page"]
  rows = -(-q.shape[1] // mosaic.ROWS)
  splits = 1
  while (splits < 8 and page_table.shape[0] * rows * splits < _SM_PROGRAMS
         and 2 * splits * max(1, mosaic_mla.KEYS // dims["slot"]) <= page_table.shape[1]):
    splits *= 2
  out = mosaic_mla.mosaic_mla_attention(q_pad[..., :latent_dim], q_pad[..., latent_dim:], pages,
                                        kv_lens, table, sm_scale=scale, num_splits=splits,
                                        interpret=interpret)
  return jnp.where(valid[:, None, None], out[seq, row], 0).astype(q.dtype)


def _ragged_paged_xla(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q, window,
                      sinks, scale, v_head_dim, layer, kv_scales):
  # Reference path: gather each sequence's pages into a contiguous [B, S]
  # view and lay the ragged queries out as [B, max_q]; then the dense kernel.
  B, pages = page_table.shape
  dims = kernel_dims(k_pages)
  K, page_size = dims["kv_head"], dims["slot"]

  def gather(pool, scale):  # [L, K, P, ps, H] -> [B, pages * ps, K, H] of `layer`
    g = pool[layer, :, page_table]  # [B, pages, K, ps, H] (one gather)
    g = g.transpose(0, 1, 3, 2, 4).reshape(B, pages * page_size, K, pool.shape[-1])
    return g if scale is None else dequantize(g, scale, q.dtype)

  q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q, dtype=jnp.int32)[None]
  k = gather(k_pages, kv_scales[0])
  v = k[..., :v_head_dim] if v_pages is None else gather(v_pages, kv_scales[1])
  out = _attention_xla(q_pad, k, v, q_pos, kv_lens, window, sinks, scale)
  out = out[seq, row]
  return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
