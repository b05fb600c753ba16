"""Work items of several 64-row tiles on Mosaic GPU (Hopper, jax >= 0.11):
the prefill form of `mosaic_paged_attention.launch`.

`launch` gives each (KV head, work item, split) one warpgroup and one 64-row
tile of query rows (token x group head), so a prefill chunk reads its keys
and values once per 64 // G tokens. Here an item holds `tiles` 64-row tiles
(TILES = 2: "wide items"; CLUSTER_TILES = 4 in clusters) and its program
runs one warpgroup per tile over the same K / V blocks in shared memory: the
chunk's KV is read once per tiles x 64 // G tokens. Warpgroup 0 also issues
the TMA copies; a slot is refilled once every warpgroup has arrived on its
release barrier, as in `mosaic_mla_attention`. P goes to wgmma from
registers and the P V product accumulates onto the output in place (as
jax's `attention_mgpu`), so a warpgroup holds one [64, D] float32
accumulator and one [64, keys] score tile: 4 tiles fit Hopper's registers
(128 a thread). The normalised output leaves in q's dtype through q's
shared-memory tile. Same results and masking as `launch` (causal, window);
a decode token's item leaves its other tiles to padding rows, so decode
steps keep `launch`.

cluster > 1 (`launch`'s `spans`): a sequence's consecutive items, up to
`cluster` of them, run as one cluster of programs over the union of their
key blocks: each block is copied from HBM once for the cluster (a TMA
multicast into every member's shared memory) and a slot refilled once every
warpgroup of the cluster has released it (a cluster barrier). Each member
masks its own rows (a member past the sequence's items computes on zero
rows); a chunk's KV is then read once per cluster x tiles x 64 // G tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels.mosaic_paged_attention import (ROWS, INTERPRETER, LOG2E, finish, plgpu,
                                                   softmax_init, softmax_step)

TILES = 2  # wide items: 64-row tiles (warpgroups) an item holds
CLUSTER_TILES = 4  # clustered items: the most whose accumulators fit the registers


def smem_bytes(D: int, page_size: int, slots: int, itemsize: int = 2,
               block_keys: int = mpa.MIN_KEYS, tiles: int = TILES) -> int:
  """Every tile's q (then its output) and lse; `slots` K and V blocks, shared."""
  keys = page_size * mpa.pages_per_block(page_size, block_keys)
  return itemsize * (tiles * ROWS * D + 2 * slots * keys * D) + 4 * tiles * ROWS


def _span(dims, item_ref, span_ref, glob_ref, split):
  """-> (this program's item, its sequence, its row 0's position, its key
  end, the window, the key blocks [lo, hi) it streams): its item's own, or
  in a cluster the union of the members' (span_ref [clusters, 3])."""
  G, D, ps, ppb, slots, num_splits, scale, cluster, *_ = dims
  if cluster == 1:
    i = lax.axis_index("items")
    return (i, *mpa.item_span(item_ref, glob_ref, i, split, ps * ppb, num_splits))
  c = lax.axis_index("clusters")
  i = c * cluster + lax.axis_index("members")
  b, _, _, window, lo, hi = mpa.item_span(span_ref, glob_ref, c, split, ps * ppb, num_splits)
  return i, b, item_ref[i, 1], item_ref[i, 2], window, lo, hi


def _body(dims, q_ref, k_ref, v_ref, item_ref, tab_ref, glob_ref, span_ref, o_ref, lse_ref,
          q_smem, k_smem, v_smem, lse_smem, q_bar, k_bar, v_bar, used_bar, *p_smem):
  """One (KV head, work item, split), as `mosaic_paged_attention._body`; in
  a cluster, one member."""
  G, D, ps, ppb, slots, num_splits, scale, cluster, tiles = dims
  kh, split = lax.axis_index("heads"), lax.axis_index("splits")
  wg = lax.axis_index("wg")
  i, b, pos0, end, window, lo, hi = _span(dims, item_ref, span_ref, glob_ref, split)
  issue = mpa.kv_issuer(k_ref, v_ref, tab_ref, glob_ref[0], kh, b,
                        (k_smem, v_smem, k_bar, v_bar), ps, ppb,
                        collective_axes="members" if cluster > 1 else None)

  @pl.when(wg == 0)
  def _():
    for s in range(slots):
      pl.when(lo + s < hi)(lambda s=s: issue(lo + s, s))
  span = (lo, hi, pos0, end, window)
  ins = (q_ref.at[i, kh], q_bar, k_bar, v_bar, used_bar)
  out = (o_ref.at[split, i, kh], lse_ref.at[split, i, kh])
  for w in range(tiles):
    pl.when(wg == w)(lambda w=w: _compute(w, dims, span, issue, ins, out, q_smem, k_smem, v_smem,
                                          lse_smem, p_smem))


def _compute(w, dims, span, issue, ins, out, q_smem, k_smem, v_smem, lse_smem, p_smem):
  """Warpgroup w: rows [64 w, 64 (w + 1)) of the item over every block (its
  own q tile copied by itself: one copy of all would stride 6 dimensions).
  p_smem: [the P tiles] where interpreted (Mosaic GPU's interpreter takes
  neither a register operand nor a stateful wgmma), else []."""
  G, D, ps, ppb, slots, num_splits, scale, *_ = dims
  lo, hi, pos0, _, window = span
  q_item, q_bar, k_bar, v_bar, used_bar = ins
  plgpu.copy_gmem_to_smem(q_item.at[w], q_smem.at[w], q_bar.at[w])
  plgpu.barrier_wait(q_bar.at[w])
  keys = ps * ppb
  lay = plgpu.Layout.WGMMA
  row = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 0, layout=lay)
  col = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 1, layout=lay)
  # query position - key column: one array live across the loop, not three. A row
  # of a held token sees no key past the item's end (causal); other rows are dropped.
  ahead = pos0 + lax.div(w * ROWS + row, jnp.int32(G)) - col

  def step(blk, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(blk - lo, jnp.int32(slots))
    plgpu.barrier_wait(k_bar.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[w], k_smem.at[slot].T)
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, keys), jnp.float32)) * (scale * LOG2E)
    d = ahead - blk * keys  # query position - key position
    visible = (d >= 0) & ((window == 0) | (d < window))
    p, alpha, m_new, l_i = softmax_step(s, visible, m_i, l_i)
    p16 = p.astype(v_smem.dtype)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if p_smem:  # interpreted: P through shared memory, the product added (same sum)
      p_smem[0].at[w][...] = p16
      plgpu.commit_smem()
    plgpu.barrier_wait(v_bar.at[slot])

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem[0].at[w] if p_smem else p16, v_smem.at[slot])
    if p_smem:
      acc = acc + pl.run_scoped(lambda r: pv(r) or r[...], plgpu.ACC((ROWS, D), jnp.float32))
    else:  # P from registers, accumulated onto acc in place: one [64, D] accumulator
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(used_bar.at[slot])
    if w == 0:  # refill the slot once every warpgroup is done with it
      @pl.when(blk + slots < hi)
      def _():
        plgpu.barrier_wait(used_bar.at[slot])
        issue(blk + slots, slot)
    return acc, m_new, l_i

  o_, lse_ = finish(*lax.fori_loop(lo, hi, step, softmax_init(D)))
  q_smem.at[w][...], lse_smem.at[w][...] = o_.astype(q_smem.dtype), lse_
  if w == 0:
    mpa.wait_last_releases(used_bar, lo, hi, slots)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem.at[w], out[0].at[pl.ds(w * ROWS, ROWS)])
  plgpu.copy_smem_to_gmem(lse_smem.at[w], out[1].at[pl.ds(w * ROWS, ROWS)])
  plgpu.wait_smem_to_gmem(0)


def launch(rows, k_pages, v_pages, items, page_indices, layer, window, *, G, scale,
           num_splits, slots, block_keys, interpret, spans=None, cluster=1):
  """As `mosaic_paged_attention.launch` with rows [I, K, tiles x 64, D] ->
  (outputs [W, I, K, tiles x 64, D] in rows' dtype (each split's own
  normalised), log-sum-exps [W, I, K, tiles x 64] float32). cluster > 1:
  item c * cluster + m is member m of cluster c, which streams the key
  blocks of spans[c] = (sequence, first item's position, last item's end)
  (I = clusters x cluster)."""
  I, K, R, D = rows.shape
  tiles = R // ROWS
  ps = k_pages.shape[-2]
  ppb = mpa.pages_per_block(ps, block_keys)
  table = page_indices.astype(jnp.int32)
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % ppb)))
  keys = ps * ppb
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  dims = (G, D, ps, ppb, slots, num_splits, float(scale), cluster, tiles)
  if cluster > 1:
    grid = dict(grid=(K, I // cluster, num_splits), grid_names=("heads", "clusters", "splits"),
                cluster=(cluster,), cluster_names=("members",))
    used = plgpu.ClusterBarrier(collective_axes=("members",), num_arrivals=tiles,
                                num_barriers=slots)
  else:
    grid = dict(grid=(K, I, num_splits), grid_names=("heads", "items", "splits"))
    used = plgpu.Barrier(num_arrivals=tiles, num_barriers=slots)
    spans = jnp.zeros((1, 3), jnp.int32)
  kernel = plgpu.kernel(
      lambda *refs: _body(dims, *refs),
      out_type=(jax.ShapeDtypeStruct((num_splits, I, K, R, D), rows.dtype),
                jax.ShapeDtypeStruct((num_splits, I, K, R), jnp.float32)),
      scratch_types=(plgpu.SMEM((tiles, ROWS, D), rows.dtype, transforms=swizzled),
                     plgpu.SMEM((slots, keys, D), rows.dtype, transforms=swizzled),
                     plgpu.SMEM((slots, keys, D), rows.dtype, transforms=swizzled),
                     plgpu.SMEM((tiles, ROWS), jnp.float32),
                     plgpu.Barrier(num_barriers=tiles),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
                     used,
                     *([plgpu.SMEM((tiles, ROWS, keys), rows.dtype, transforms=swizzled)]
                       if interpret else [])),
      num_threads=tiles, thread_name="wg", **grid,
      interpret=INTERPRETER() if interpret else False)
  glob = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
  return kernel(rows.reshape(I, K, tiles, ROWS, D), k_pages, v_pages, items.astype(jnp.int32),
                table, glob, spans.astype(jnp.int32))
