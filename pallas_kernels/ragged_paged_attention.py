"""Ragged paged attention: one call for an engine step's mixed batch.

  q            [T, N, D]: the step's tokens flattened; sequence b owns rows
               cu_q_lens[b]:cu_q_lens[b + 1] (prefill chunks and decode tokens alike)
  k_pages      [K, P, page_size, D]; v_pages [K, P, page_size, Dv] or None
               (values = the first v_head_dim columns of the keys: MLA)
  kv_lens      [B] KV tokens of each sequence after this step
  k_scale      None, or float32 scalars: quantized pages (fp8 / int8) read as
  v_scale      pages * scale, per tile in the kernel (MLA: k_scale only)
  page_indices [B, pages_per_seq]; max_q (static) >= every sequence's query count
  -> [T, N, Dv]; rows past cu_q_lens[-1] (padding) are 0.

The kernel (`paged_attention.ragged_core`) tiles each sequence's queries into
query-block work items: a decode token is one small item, a prefill chunk of
q tokens ceil(q / block_q) items; no sequence is padded to max_q.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import (PagedBlocks, check_tiles, paged_attention_reference,
                                            ragged_core, to_padded, validate_paged)


def _check(q, cu_q_lens, kv_lens, max_q):
  if q.ndim != 3:
    raise ValueError(f"ragged_paged_attention: q must be [T, N, D], got {q.shape}")
  if cu_q_lens.shape != (kv_lens.shape[0] + 1,):
    raise ValueError(f"ragged_paged_attention: cu_q_lens must be [B + 1 = {kv_lens.shape[0] + 1}], "
                     f"got {cu_q_lens.shape}")
  if not isinstance(max_q, int) or max_q < 1:
    raise ValueError(f"ragged_paged_attention: max_q must be a static int >= 1, got {max_q!r}")


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, max_q,
                           sm_scale=None, window=0, sinks=None, v_head_dim=None,
                           pages_per_compute_block=1, num_splits=1, num_warps=4, num_stages=2,
                           layer=None, k_scale=None, v_scale=None, interpret=False):
  """See the module docstring. layer: pools are stacked [L, K, P, page_size, D]
  and this (possibly traced) layer is read, e.g. from inside a layer scan."""
  _check(q, cu_q_lens, kv_lens, max_q)
  one_layer = (lambda a: a if a is None or layer is None else a[0])
  B = kv_lens.shape[0]
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  q_shape = jax.ShapeDtypeStruct((B, max_q, *q.shape[1:]), q.dtype)  # for the checks
  validate_paged(q_shape, one_layer(k_pages), one_layer(v_pages), kv_lens, page_indices,
                 window=window, sinks=sinks, name="ragged_paged_attention", q_lens=q_lens,
                 k_scale=k_scale, v_scale=v_scale)
  blocks = PagedBlocks(pages_per_compute_block, num_splits, num_warps, num_stages)
  blocks.validate()
  D = q.shape[-1]
  dv = v_head_dim if v_pages is None else v_pages.shape[-1]
  check_tiles(D, dv, k_pages.shape[-2], blocks, interpret, "ragged_paged_attention")
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  return ragged_core(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, max_q=max_q,
                     scale=scale, window=window, sinks=sinks, dv=v_head_dim, blocks=blocks,
                     layer=layer, k_scale=k_scale, v_scale=v_scale, interpret=interpret)


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *,
                                     max_q, sm_scale=None, window=0, sinks=None, v_head_dim=None,
                                     k_scale=None, v_scale=None):
  """Pure jnp, float32: `ragged_paged_attention`'s semantics through `paged_attention_reference`."""
  _check(q, cu_q_lens, kv_lens, max_q)
  q_pad, seq, row, valid = to_padded(q, cu_q_lens, max_q)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  out = paged_attention_reference(q_pad, k_pages, v_pages, kv_lens, page_indices,
                                  sm_scale=sm_scale, window=window, sinks=sinks, dv=v_head_dim,
                                  q_lens=q_lens, k_scale=k_scale, v_scale=v_scale)
  return jnp.where(valid[:, None, None], out[seq, row], 0).astype(q.dtype)
