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

cluster=True (with wide): a sequence longer than one item of CLUSTER_TILES
(4) 64-row tiles runs on such items, in clusters of up to CLUSTER (Hopper's
portable 8) programs that share each K / V block (`cluster_items`): a
chunk's KV is read once per CLUSTER x 256 // G tokens. The other sequences
(decodes, short chunks) keep the wide items; the step takes two launches,
each token's output taken from its sequence's, and each launch enumerates
(and gathers query rows for) its own sequences' items only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels import mosaic_wide_attention as mwa
from pallas_kernels.paged_attention import token_sequences, validate_paged
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


CLUSTER = 8  # Hopper's portable cluster size: items sharing each K / V block
# Interpreted on jax < 0.12 clusters hold 4 items: jax 0.11's Mosaic GPU interpreter
# stalls with 32 program threads a cluster (8 members x 4 warpgroups; 20 run).
INTERPRETED_CLUSTER_011 = 4


def tokens_per_item(group: int, wide: bool = False, *, tiles: int | None = None) -> int:
  """Query tokens of one work item: as many as fill its 64-row tile (wide:
  its `mosaic_wide_attention.TILES`; or `tiles` of them)."""
  tiles = tiles if tiles is not None else (mwa.TILES if wide else 1)
  return max(1, tiles * mpa.ROWS // group)


def max_items(num_tokens: int, num_seqs: int, group: int, wide: bool = False, *,
              tiles: int | None = None) -> int:
  """A static bound on a step's work items: every sequence adds at most one
  partial item, and every item holds at least one token."""
  return min(num_tokens // tokens_per_item(group, wide, tiles=tiles) + num_seqs, num_tokens)


def work_items(cu_q_lens, kv_lens, *, per_item: int, num_items: int, keep=None):
  """-> (items [I, 3] int32: sequence, position of the item's first query,
  end of its keys (0 for unused items); first token [I]; first item of
  each sequence [B + 1]). keep [B] bool: only these sequences get items
  (the others none: their tokens' item indices are meaningless)."""
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  counts = -(-q_lens // per_item)
  if keep is not None:
    counts = jnp.where(keep, counts, 0)
  item_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
  i = jnp.arange(num_items, dtype=jnp.int32)
  B = kv_lens.shape[0]
  b = jnp.clip(jnp.searchsorted(item_cu, i, side="right", method="compare_all") - 1, 0, B - 1).astype(jnp.int32)
  j = i - item_cu[b]
  live = i < item_cu[-1]
  pos0 = kv_lens[b] - q_lens[b] + j * per_item
  ntok = jnp.clip(q_lens[b] - j * per_item, 0, per_item)
  items = jnp.stack([jnp.where(live, b, 0), jnp.where(live, pos0, 0),
                     jnp.where(live, pos0 + ntok, 0)], axis=1)
  return items.astype(jnp.int32), cu_q_lens[b] + j * per_item, item_cu


def cluster_items(items, item_cu, *, cluster: int, num_clusters: int):
  """The items of sequences holding two or more, in clusters of `cluster`
  consecutive items of one sequence -> (member items [num_clusters *
  cluster, 3] (a member past its sequence's items: that sequence, position
  0, end 0), spans [num_clusters, 3] (sequence, the first member's position,
  the last member's end; (0, 0, 0) unused), item index of each member
  [num_clusters * cluster] (-1: none))."""
  counts = item_cu[1:] - item_cu[:-1]
  per_seq = jnp.where(counts >= 2, -(-counts // cluster), 0)
  c_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_seq).astype(jnp.int32)])
  B = counts.shape[0]
  c = jnp.arange(num_clusters, dtype=jnp.int32)
  b = jnp.clip(jnp.searchsorted(c_cu, c, side="right", method="compare_all") - 1, 0, B - 1).astype(jnp.int32)
  live = c < c_cu[-1]
  j = (c - c_cu[b])[:, None] * cluster + jnp.arange(cluster, dtype=jnp.int32)[None]
  held = live[:, None] & (j < counts[b][:, None])  # [clusters, cluster]
  idx = jnp.where(held, item_cu[b][:, None] + j, -1)
  member = jnp.where(held[..., None], items[jnp.maximum(idx, 0)],
                     jnp.stack([b, jnp.zeros_like(b), jnp.zeros_like(b)], 1)[:, None])
  last = jnp.maximum(jnp.sum(held, axis=1) - 1, 0)
  spans = jnp.stack([b, member[:, 0, 1], member[c, last, 2]], axis=1)
  return member.reshape(-1, 3), jnp.where(live[:, None], spans, 0), idx.reshape(-1)


def max_clusters(num_tokens: int, num_items: int, group: int, cluster: int) -> int:
  """A static bound on `cluster_items`' clusters of num_items items of
  CLUSTER_TILES tiles: every sequence of two or more (more than one item's
  tokens) adds at most one partial cluster."""
  per = tokens_per_item(group, tiles=mwa.CLUSTER_TILES)
  return max(1, num_items // cluster + num_tokens // (per + 1))


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
                            block_keys=mpa.MIN_KEYS, layer=None, wide=False, cluster=False,
                            interpret=False):
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
  _check_wide(wide, cluster, D, k_pages.shape[-2], slots, q.dtype, block_keys)
  K = k_pages.shape[1]
  G = N // K
  kv_lens = kv_lens.astype(jnp.int32)
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
  kw = dict(G=G, scale=scale, num_splits=num_splits, slots=slots, block_keys=block_keys,
            interpret=interpret)
  tiles = mwa.TILES if wide else 1
  per = tokens_per_item(G, tiles=tiles)
  num_items, keep = max_items(T, B, G, tiles=tiles), None
  _, seq, valid = token_sequences(cu, T)
  if cluster:
    c_per = tokens_per_item(G, tiles=mwa.CLUSTER_TILES)
    c_items, c_first, c_cu = work_items(cu, kv_lens, per_item=c_per,
                                        num_items=max_items(T, B, G, tiles=mwa.CLUSTER_TILES))
    keep = (c_cu[1:] - c_cu[:-1]) < 2  # [B]: sequences not on the clustered launch
    # Each holds at most one clustered item's tokens: the wide launch is theirs only.
    num_items = min(num_items, B * -(-c_per // per))
  items, first, item_cu = work_items(cu, kv_lens, per_item=per, num_items=num_items, keep=keep)
  rows = item_rows(q, first, items, group=G, per_item=per, rows=tiles * mpa.ROWS)
  o, lse = (mwa.launch if wide else mpa.launch)(
      rows, k_pages, v_pages, items, page_indices, layer, window, **kw)
  out = to_tokens(o, lse, sinks, G, per, item_cu, cu, seq)
  if cluster:
    out = jnp.where(keep[seq][:, None, None], out,
                    _clustered(q, k_pages, v_pages, c_items, c_first, c_cu, page_indices,
                               layer, window, sinks, seq, cu, **kw))
  return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def to_tokens(o, lse, sinks, G, per, item_cu, cu, seq, slot=None):
  """A launch's split outputs o [W, I, K, R, D] and log-sum-exps -> [T, N,
  D] float32 in token order (token t of sequence seq[t]); slot: the launch's
  program of each item (clusters), else the item itself."""
  _, I, K, _, D = o.shape
  out = mpa.merge_lse(o, lse, sinks, G)[:, :, :per * G]  # [I, K, per * G, D]
  out = out.reshape(I, K, per, G, D)
  u = jnp.arange(seq.shape[0], dtype=jnp.int32) - cu[seq]
  item = item_cu[seq] + u // per
  return out[item if slot is None else slot[item], :, u % per].reshape(seq.shape[0], K * G, D)


def _clustered(q, k_pages, v_pages, items, first, item_cu, page_indices, layer, window, sinks,
               seq, cu, *, G, **kw):
  """The launch of `cluster_items` over items of CLUSTER_TILES tiles ->
  [T, N, D] float32 (the tokens of sequences of two or more such items)."""
  T, tiles = q.shape[0], mwa.CLUSTER_TILES
  C = (INTERPRETED_CLUSTER_011 if kw["interpret"] and jax.__version_info__ < (0, 12)
       else CLUSTER)
  per = tokens_per_item(G, tiles=tiles)
  member, spans, idx = cluster_items(items, item_cu, cluster=C,
                                     num_clusters=max_clusters(T, items.shape[0], G, C))
  # The members' rows, gathered once (a member of no item ends at 0: its rows are 0).
  rows = item_rows(q, first[jnp.maximum(idx, 0)], member, group=G, per_item=per,
                   rows=tiles * mpa.ROWS)
  o, lse = mwa.launch(rows, k_pages, v_pages, member, page_indices, layer, window, G=G,
                      spans=spans, cluster=C, **kw)
  I = items.shape[0]  # item i is the member that holds it (0: an item of no cluster)
  slot = jnp.zeros((I,), jnp.int32).at[jnp.where(idx >= 0, idx, I)].set(
      jnp.arange(idx.shape[0], dtype=jnp.int32), mode="drop")
  return to_tokens(o, lse, sinks, G, per, item_cu, cu, seq, slot)


def _check_wide(wide, cluster, D, page_size, slots, dtype, block_keys):
  if not isinstance(wide, bool):
    raise TypeError(f"mosaic_ragged_attention: wide must be a bool, got {wide!r}")
  if not isinstance(cluster, bool):
    raise TypeError(f"mosaic_ragged_attention: cluster must be a bool, got {cluster!r}")
  if cluster and not wide:
    raise ValueError("mosaic_ragged_attention: cluster=True clusters wide items: pass wide=True")
  tiles = mwa.CLUSTER_TILES if cluster else mwa.TILES
  used = mwa.smem_bytes(D, page_size, slots, jnp.dtype(dtype).itemsize, block_keys, tiles)
  if wide and used > mpa.SMEM_BYTES:
    raise ValueError(f"mosaic_ragged_attention: {'clustered' if cluster else 'wide'} items "
                     f"need {used} bytes of shared memory > {mpa.SMEM_BYTES} (fewer slots or "
                     "block_keys)")


def mosaic_ragged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *,
                                      max_q, sm_scale=None, window=0, sinks=None):
  """Pure jnp, float32: the same semantics (`ragged_paged_attention_reference`)."""
  return ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices,
                                          cu_q_lens, max_q=max_q, sm_scale=sm_scale,
                                          window=window, sinks=sinks)
