"""Paged attention over a KV page pool: decode (Q = 1) and multi-query verify
(Q > 1, causal among the Q), GQA, sliding window, attention sinks, split-K.

Layout (shared with the engine's page pool and jax's Pallas GPU op):
  q            [B, N, D] or [B, Q, N, D]   (Q newest tokens of each sequence)
  k_pages      [K, P, page_size, D]
  v_pages      [K, P, page_size, Dv]       (None: values = k[..., :Dv], MLA's latent)
  lengths      [B] int32, KV tokens of each sequence including its Q new ones
  page_indices [B, pages_per_seq] int32    (unused slots may point at any page, e.g. 0)

One program per (sequence, KV head, split): its rows are every query head of
the KV group times the Q query tokens, so each page is read once per KV head.
Split-K (flash-decoding): the sequence's pages are divided over `num_splits`
programs, each returning an unnormalised partial (acc, max, sum) that the
wrapper merges with log-sum-exp weights; the sinks join the denominator there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
  """pages_per_compute_block: pages loaded per inner iteration (block_k =
  that x page_size); num_splits: programs per sequence over its pages."""

  pages_per_compute_block: int = 1
  num_splits: int = 1

  def validate(self):
    for name in ("pages_per_compute_block", "num_splits"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _kernel(q_ref, k_ref, v_ref, tables_ref, lengths_ref, qlens_ref, window_ref, layer_ref,
            o_ref, m_ref, l_ref, *, scale, group, pages_per_split, ppcb, dv, values_from_keys):
  # q_ref [R, D]: rows r = query token (r // group) x head (r % group) of this KV head
  # k_ref [L, K, P, ps, D], v_ref [L, K, P, ps, Dv]: whole stacked pools (read at
  #   [layer, kv head, page]; v_ref unused when values_from_keys)
  # tables_ref [pages_per_split]; lengths_ref, qlens_ref, window_ref, layer_ref [1]
  # o_ref [R, Dv] f32; m_ref, l_ref [R] f32 (unnormalised partials of this split)
  head, split = pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  rows = q_ref.shape[0]
  page_size = k_ref.shape[3]
  block_k = ppcb * page_size
  kv_len, q_len, window = lengths_ref[0], qlens_ref[0], window_ref[0]
  q = q_ref[...].astype(jnp.float32)
  r = jnp.arange(rows, dtype=jnp.int32)
  q_pos = kv_len - q_len + r // group  # [R]
  row_valid = r < q_len * group

  first_page = split * pages_per_split
  end_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(kv_len, page_size))
  # With a window, pages wholly before every query's window are skipped.
  lo_tok = jnp.where(window > 0, kv_len - q_len - window + 1, 0)
  start_page = jnp.maximum(first_page, jnp.maximum(lo_tok, 0) // page_size)
  # Iterate over compute blocks aligned to this split's first page.
  first_block = (start_page - first_page) // ppcb
  num_blocks = pl.cdiv(jnp.maximum(end_page - first_page, 0), ppcb)

  def body(blk, carry):
    acc, m, l = carry
    local = blk * ppcb
    pages = [tables_ref[local + i] for i in range(ppcb)]
    k = jnp.concatenate([k_ref[layer, head, p] for p in pages]).astype(jnp.float32)
    if values_from_keys:
      v = k[:, :dv]
    else:
      v = jnp.concatenate([v_ref[layer, head, p] for p in pages]).astype(jnp.float32)
    s = jnp.dot(q, k.T) * scale  # [R, block_k]
    k_pos = (first_page + local) * page_size + jnp.arange(block_k, dtype=jnp.int32)
    mask = (k_pos[None, :] < kv_len) & (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
    mask &= (window == 0) | (q_pos[:, None] - k_pos[None, :] < window)
    s = jnp.where(mask, s, MASK)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    return corr[:, None] * acc + jnp.dot(p, v), m_new, corr * l + p.sum(axis=-1)

  init = (jnp.zeros((rows, dv), jnp.float32), jnp.full((rows,), MASK, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(first_block, num_blocks, body, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def paged_attention_core(q, k_pages, v_pages, lengths, page_indices, q_lens, *, scale,
                         window=0, sinks=None, dv=None, blocks: PagedBlocks = PagedBlocks(),
                         layer=None, interpret=False, _out_init=None):
  """q [B, Q, N, D] (each sequence's first q_lens[b] rows are real) -> [B, Q, N, Dv].
  Shared by paged, MLA and ragged attention; callers validate inputs.
  layer: the pools carry a leading layer axis ([L, K, P, ps, D]) and this
  (possibly traced) layer is read, without slicing it out of the stack."""
  if layer is None:
    k_pages = k_pages[None]
    v_pages = None if v_pages is None else v_pages[None]
    layer = 0
  B, Q, N, D = q.shape
  _, K, _, page_size, _ = k_pages.shape
  values_from_keys = v_pages is None
  dv = dv if values_from_keys else v_pages.shape[-1]
  G = N // K
  ppcb = blocks.pages_per_compute_block
  splits = blocks.num_splits
  pps = page_indices.shape[1]
  pages_per_split = -(-pps // splits)
  pages_per_split = -(-pages_per_split // ppcb) * ppcb
  tables = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pages_per_split * splits - pps)))
  rows = Q * G
  rows_pad = max(16, 1 << (rows - 1).bit_length())
  # [B, Q, K, G, D] -> [B, K, Q * G, D]: a KV head's query heads and tokens as rows.
  qr = q.reshape(B, Q, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, rows, D)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
  window_arr = jnp.asarray(window, jnp.int32).reshape(1)
  kernel = functools.partial(_kernel, scale=scale, group=G, pages_per_split=pages_per_split,
                             ppcb=ppcb, dv=dv, values_from_keys=values_from_keys)
  whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, s: (0,) * a.ndim)
  in_specs = [
      pl.BlockSpec((None, None, rows_pad, D), lambda b, h, s: (b, h, 0, 0)),
      whole(k_pages),
      None if values_from_keys else whole(v_pages),
      pl.BlockSpec((None, pages_per_split), lambda b, h, s: (b, s)),
      pl.BlockSpec((1,), lambda b, h, s: (b,)),
      pl.BlockSpec((1,), lambda b, h, s: (b,)),
      pl.BlockSpec((1,), lambda b, h, s: (0,)),
      pl.BlockSpec((1,), lambda b, h, s: (0,)),
  ]
  out_shape = [jax.ShapeDtypeStruct((B, K, splits, rows_pad, dv), jnp.float32),
               jax.ShapeDtypeStruct((B, K, splits, rows_pad), jnp.float32),
               jax.ShapeDtypeStruct((B, K, splits, rows_pad), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, None, rows_pad, dv), lambda b, h, s: (b, h, s, 0, 0)),
               pl.BlockSpec((None, None, None, rows_pad), lambda b, h, s: (b, h, s, 0)),
               pl.BlockSpec((None, None, None, rows_pad), lambda b, h, s: (b, h, s, 0))]
  args = [qr, k_pages, v_pages, tables, lengths.astype(jnp.int32), q_lens.astype(jnp.int32),
          window_arr, jnp.asarray(layer, jnp.int32).reshape(1)]
  aliases = {}
  if _out_init is not None:  # tests: a poisoned output buffer
    in_specs.append(out_specs[0])
    aliases = {len(args): 0}
    args.append(_out_init)
  if values_from_keys:
    in_specs.pop(2)
    args.pop(2)
    aliases = {i - 1: o for i, o in aliases.items()}
    kernel = functools.partial(_drop_arg, kernel, 2)
  if _out_init is not None:
    kernel = functools.partial(_ignore_alias_input, kernel, len(args) - 1)
  acc, m, l = pl.pallas_call(kernel, grid=(B, K, splits), in_specs=in_specs,
                             out_specs=out_specs, out_shape=out_shape,
                             input_output_aliases=aliases, interpret=interpret)(*args)
  # Merge the splits (log-sum-exp); sinks add exp(sink - m) to the denominator.
  m_all = jnp.max(m, axis=2)  # [B, K, R]
  w = jnp.exp(m - m_all[:, :, None])
  num = jnp.sum(acc * w[..., None], axis=2)
  den = jnp.sum(l * w, axis=2)
  if sinks is not None:
    sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(K, G), (1, Q))  # row r -> head r % G
    sink_rows = jnp.pad(sink_rows, ((0, 0), (0, rows_pad - rows)), constant_values=MASK)
    den = den + jnp.exp(sink_rows[None] - m_all)
  out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
  out = out[:, :, :rows].reshape(B, K, Q, G, dv).transpose(0, 2, 1, 3, 4)
  return out.reshape(B, Q, N, dv).astype(q.dtype)


def _drop_arg(kernel, index, *refs):
  return kernel(*refs[:index], None, *refs[index:])


def _ignore_alias_input(kernel, index, *refs):
  return kernel(*refs[:index], *refs[index + 1:])


def validate_paged(q, k_pages, v_pages, lengths, page_indices, *, window, sinks, name,
                   q_lens=None):
  """Shape and dtype checks shared by the paged wrappers (ValueError/TypeError)."""
  def need(ok, msg, exc=ValueError):
    if not ok:
      raise exc(f"{name}: {msg}")

  need(q.ndim == 4, f"q must be [B, Q, N, D] (or [B, N, D]), got shape {q.shape}")
  need(k_pages.ndim == 4, f"k_pages must be [K, P, page_size, D], got shape {k_pages.shape}")
  B, Q, N, D = q.shape
  K = k_pages.shape[0]
  need(N % K == 0, f"query heads ({N}) must be a multiple of KV heads ({K})")
  need(k_pages.shape[-1] == D, f"k_pages head dim {k_pages.shape[-1]} != q head dim {D}")
  if v_pages is not None:
    need(v_pages.ndim == 4 and v_pages.shape[:3] == k_pages.shape[:3],
         f"v_pages must be [K, P, page_size, Dv] matching k_pages {k_pages.shape[:3]}, "
         f"got {v_pages.shape}")
  need(lengths.shape == (B,), f"lengths must be [B={B}], got {lengths.shape}")
  need(page_indices.ndim == 2 and page_indices.shape[0] == B,
       f"page_indices must be [B={B}, pages_per_seq], got {page_indices.shape}")
  need(jnp.issubdtype(lengths.dtype, jnp.integer), f"lengths must be integer, got {lengths.dtype}",
       TypeError)
  need(jnp.issubdtype(page_indices.dtype, jnp.integer),
       f"page_indices must be integer, got {page_indices.dtype}", TypeError)
  need(jnp.issubdtype(q.dtype, jnp.floating), f"q must be floating, got {q.dtype}", TypeError)
  need(q.dtype == k_pages.dtype, f"q dtype {q.dtype} != k_pages dtype {k_pages.dtype}", TypeError)
  need(sinks is None or sinks.shape == (N,), f"sinks must be [N={N}], got "
       f"{None if sinks is None else sinks.shape}")
  if isinstance(window, int):
    need(window >= 0, f"window must be >= 0, got {window}")
  if not isinstance(lengths, jax.core.Tracer):
    need(int(jnp.max(lengths)) <= page_indices.shape[1] * k_pages.shape[2],
         f"a length exceeds pages_per_seq x page_size = {page_indices.shape[1] * k_pages.shape[2]}")
    min_len = Q if q_lens is None else q_lens
    need(bool(jnp.all(lengths >= min_len)),
         "lengths must be >= each sequence's query count (they include the new tokens)")


def paged_attention(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None, window=0,
                    sinks=None, pages_per_compute_block=1, num_splits=1, interpret=False,
                    _out_init=None):
  """Paged decode / verify attention (layout in the module docstring).

  q [B, N, D] -> [B, N, Dv]; q [B, Q, N, D] -> [B, Q, N, Dv], the Q queries
  at positions lengths - Q .. lengths - 1, causal among themselves.
  """
  squeeze = q.ndim == 3
  q4 = q[:, None] if squeeze else q
  validate_paged(q4, k_pages, v_pages, lengths, page_indices, window=window, sinks=sinks,
                 name="paged_attention")
  blocks = PagedBlocks(pages_per_compute_block, num_splits)
  blocks.validate()
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
  q_lens = jnp.full((q4.shape[0],), q4.shape[1], jnp.int32)
  out = paged_attention_core(q4, k_pages, v_pages, lengths, page_indices, q_lens, scale=scale,
                             window=window, sinks=sinks, blocks=blocks, interpret=interpret,
                             _out_init=_out_init)
  return out[:, 0] if squeeze else out


def paged_attention_reference(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None,
                              window=0, sinks=None, dv=None, q_lens=None):
  """Pure jnp, float32: gather each sequence's pages, dense masked softmax."""
  squeeze = q.ndim == 3
  q4 = (q[:, None] if squeeze else q).astype(jnp.float32)
  B, Q, N, D = q4.shape
  K, _, ps, _ = k_pages.shape
  G = N // K
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  k = k_pages[:, page_indices].astype(jnp.float32)  # [K, B, pages, ps, D]
  k = k.reshape(K, B, -1, D).transpose(1, 2, 0, 3)  # [B, S, K, D]
  if v_pages is None:
    v = k[..., :dv]
  else:
    v = v_pages[:, page_indices].astype(jnp.float32).reshape(K, B, -1, v_pages.shape[-1])
    v = v.transpose(1, 2, 0, 3)
  S = k.shape[1]
  q_lens = jnp.full((B,), Q, jnp.int32) if q_lens is None else q_lens
  q_pos = (lengths - q_lens)[:, None] + jnp.arange(Q)[None]  # [B, Q]
  k_pos = jnp.arange(S)
  s = jnp.einsum("bqkgd,bskd->bkgqs", q4.reshape(B, Q, K, G, D), k) * scale
  mask = (k_pos[None, None] < lengths[:, None, None]) & (k_pos[None, None] <= q_pos[..., None])
  if window:
    mask &= q_pos[..., None] - k_pos[None, None] < window
  mask &= (jnp.arange(Q)[None] < q_lens[:, None])[..., None]
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32).reshape(1, K, G, 1, 1))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  den = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    den = den + jnp.exp(sinks.astype(jnp.float32).reshape(1, K, G, 1, 1) - m)
  p = e / jnp.where(den > 0, den, 1.0)
  out = jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(B, Q, N, v.shape[-1])
  return (out[:, 0] if squeeze else out).astype(q.dtype)
