"""Ragged paged attention on Mosaic GPU (Hopper, jax >= 0.11): an engine
step's mixed batch, prefill chunks and decode tokens, in one launch.

Same layout and meaning as `ragged_paged_attention` (q [T, N, D] token-
flattened, sequence b owning rows cu_q_lens[b]:cu_q_lens[b + 1], the last at
position kv_lens[b] - 1; pages [(L,) K, P, page_size, D]), on the kernel of
`mosaic_paged_attention` (TMA page loads, wgmma, online softmax, split-K).

Work items: each sequence's query tokens are cut into items of
`tokens_per_item` = 64 // G whole tokens (G query heads per KV head), so an
item's rows (token x group head) fill one 64-row wgmma tile. A decode token
is one item, a prefill chunk of q tokens ceil(q / tokens_per_item) items; no
sequence is padded to the longest. One program per (KV head, item, split)
streams the item's keys up to its last query (causal within the chunk), so
a chunk's KV is read once per item, as in FlashAttention's query blocks.

The items are built on the device from cu_q_lens and kv_lens (`work_items`),
the query rows gathered into them and the outputs gathered back in token
order; rows past cu_q_lens[-1] (padding) are 0.

wide=True: items of two 64-row tiles (128 // G tokens) on two warpgroups
sharing each K / V block (`mosaic_wide_attention`): a chunk's KV is read
half as often, for prefill-heavy steps; a decode token's item then fills
one tile of two.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_wide_attention as mwa
from pallas_kernels.paged_attention import validate_paged
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


def tokens_per_item(group: int, wide: bool = False) -> int:
  """Query tokens of one work item: as many as fill its 64-row tile (wide:
  its two tiles)."""
  return max(1, (mwa.WIDE_ROWS if wide else mpa.ROWS) // group)


def max_items(num_tokens: int, num_seqs: int, group: int, wide: bool = False) -> int:
  """A static bound on a step's work items: every sequence adds at most one
  partial item, and every item holds at least one token."""
  return min(num_tokens // tokens_per_item(group, wide) + num_seqs, num_tokens)


def work_items(cu_q_lens, kv_lens, *, per_item: int, num_items: int):
  """-> (items [I, 3] int32: sequence, position of the item's first query,
  end of its keys (0 for unused items); first token [I]; first item of
  each sequence [B + 1])."""
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  counts = -(-q_lens // per_item)
  item_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
  i = jnp.arange(num_items, dtype=jnp.int32)
  B = kv_lens.shape[0]
  b = jnp.clip(jnp.searchsorted(item_cu, i, side="right") - 1, 0, B - 1).astype(jnp.int32)
  j = i - item_cu[b]
  live = i < item_cu[-1]
  pos0 = kv_lens[b] - q_lens[b] + j * per_item
  ntok = jnp.clip(q_lens[b] - j * per_item, 0, per_item)
  items = jnp.stack([jnp.where(live, b, 0), jnp.where(live, pos0, 0),
                     jnp.where(live, pos0 + ntok, 0)], axis=1)
  return items.astype(jnp.int32), cu_q_lens[b] + j * per_item, item_cu


def item_rows(q, first_token, items, *, group: int, per_item: int, rows: int = mpa.ROWS):
  """q [T, N, D] -> rows [I, K, rows, D]: item i's tokens x group heads of
  each KV head; rows of tokens the item does not hold are 0."""
  T, N, D = q.shape
  K = N // group
  u = jnp.arange(per_item, dtype=jnp.int32)
  tok = first_token[:, None] + u[None]  # [I, per_item]
  held = (items[:, 1:2] + u[None]) < items[:, 2:3]
  x = jnp.where(held[..., None, None], q[jnp.clip(tok, 0, T - 1)], 0)  # [I, u, N, D]
  x = x.reshape(-1, per_item, K, group, D).transpose(0, 2, 1, 3, 4)
  x = x.reshape(-1, K, per_item * group, D)
  return jnp.pad(x, ((0, 0), (0, 0), (0, rows - per_item * group), (0, 0)))


def mosaic_ragged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, max_q,
                            sm_scale=None, window=0, sinks=None, num_splits=1, slots=2,
                            block_keys=mpa.MIN_KEYS, layer=None, wide=False, interpret=False):
  """See the module docstring. q [T, N, D] -> [T, N, D]; max_q (static) >=
  every sequence's query count (checked like `ragged_paged_attention`)."""
  if q.ndim != 3:
    raise ValueError(f"mosaic_ragged_attention: q must be [T, N, D], got {q.shape}")
  if cu_q_lens.shape != (kv_lens.shape[0] + 1,):
    raise ValueError(f"mosaic_ragged_attention: cu_q_lens must be [B + 1 = "
                     f"{kv_lens.shape[0] + 1}], got {cu_q_lens.shape}")
  if not isinstance(max_q, int) or max_q < 1:
    raise ValueError(f"mosaic_ragged_attention: max_q must be a static int >= 1, got {max_q!r}")
  k_pages, v_pages, layer = mpa.stacked_pools(k_pages, v_pages, layer, "mosaic_ragged_attention")
  T, N, D = q.shape
  B = kv_lens.shape[0]
  view = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  cu = cu_q_lens.astype(jnp.int32)
  validate_paged(jax.ShapeDtypeStruct((B, max_q, N, D), q.dtype), view(k_pages), view(v_pages),
                 kv_lens, page_indices, window=window, sinks=sinks,
                 name="mosaic_ragged_attention", q_lens=cu[1:] - cu[:-1])
  mpa.check_call(jax.ShapeDtypeStruct((1, 1, N, D), q.dtype), k_pages, v_pages, slots,
                 num_splits, block_keys, "mosaic_ragged_attention")
  _check_wide(wide, D, k_pages.shape[-2], slots, q.dtype, block_keys)
  K = k_pages.shape[1]
  G = N // K
  per = tokens_per_item(G, wide)
  I = max_items(T, B, G, wide)
  kv_lens = kv_lens.astype(jnp.int32)
  items, first, item_cu = work_items(cu, kv_lens, per_item=per, num_items=I)
  rows = item_rows(q, first, items, group=G, per_item=per,
                   rows=mwa.WIDE_ROWS if wide else mpa.ROWS)
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  o, lse = (mwa.launch if wide else mpa.launch)(
      rows, k_pages, v_pages, items, page_indices, layer, window, G=G, scale=scale,
      num_splits=num_splits, slots=slots, block_keys=block_keys, interpret=interpret)
  out = mpa.merge_lse(o, lse, sinks, G)[:, :, :per * G]  # [I, K, per * G, D]
  out = out.reshape(I, K, per, G, D)
  t = jnp.arange(T, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, B - 1)
  u = t - cu[seq]
  picked = out[item_cu[seq] + u // per, :, u % per]  # [T, K, G, D]
  valid = t < cu[-1]
  return jnp.where(valid[:, None, None], picked.reshape(T, N, D), 0).astype(q.dtype)


def _check_wide(wide, D, page_size, slots, dtype, block_keys):
  if not isinstance(wide, bool):
    raise TypeError(f"mosaic_ragged_attention: wide must be a bool, got {wide!r}")
  used = mwa.smem_bytes(D, page_size, slots, jnp.dtype(dtype).itemsize, block_keys)
  if wide and used > mpa.SMEM_BYTES:
    raise ValueError(f"mosaic_ragged_attention: wide items need {used} bytes of shared memory "
                     f"> {mpa.SMEM_BYTES} (fewer slots or block_keys)")


def mosaic_ragged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *,
                                      max_q, sm_scale=None, window=0, sinks=None):
  """Pure jnp, float32: the same semantics (`ragged_paged_attention_reference`)."""
  return ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices,
                                          cu_q_lens, max_q=max_q, sm_scale=sm_scale,
                                          window=window, sinks=sinks)
