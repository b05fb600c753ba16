"""Work items of two 64-row tiles on Mosaic GPU (Hopper, jax >= 0.11): the
prefill form of `mosaic_paged_attention.launch`.

`launch` gives each (KV head, work item, split) one warpgroup and one 64-row
tile of query rows (token x group head), so a prefill chunk reads its keys
and values once per 64 // G tokens. Here an item holds 128 rows and its
program runs two warpgroups, one per 64-row tile, over the same K / V blocks
in shared memory: the chunk's KV is read once per 128 // G tokens (half as
often) and two warpgroups issue wgmma where one did. Warpgroup 0 also issues
the TMA copies; a slot is refilled once both have arrived on its release
barrier, as in `mosaic_mla_attention`. Same results and masking as `launch`
(causal, window, keys < the item's end); a decode token's item leaves its
second tile to padding rows, so decode steps keep `launch`.

cluster > 1 (`launch`'s `spans`): a sequence's consecutive items, up to
`cluster` of them, run as one cluster of programs over the union of their
key blocks: each block is copied from HBM once for the cluster (a TMA
multicast into every member's shared memory) and a slot refilled once every
warpgroup of the cluster has released it (a cluster barrier). Each member
masks its own rows (a member past the sequence's items computes on zero
rows); a chunk's KV is then read once per cluster x 128 // G tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import mosaic_paged_attention as mpa
from pallas_kernels.mosaic_paged_attention import (ROWS, _INTERPRETER, _LOG2E, finish, plgpu,
                                                   softmax_init, softmax_step)

WGS = 2  # warpgroups, each with one 64-row tile of the item
WIDE_ROWS = WGS * ROWS


def smem_bytes(D: int, page_size: int, slots: int, itemsize: int = 2,
               block_keys: int = mpa.MIN_KEYS) -> int:
  """Both tiles' q, P, f32 output and lse; `slots` K and V blocks, shared."""
  keys = page_size * mpa.pages_per_block(page_size, block_keys)
  return (itemsize * (WIDE_ROWS * D + 2 * slots * keys * D + WIDE_ROWS * keys)
          + 4 * (WIDE_ROWS * D + WIDE_ROWS))


def _span(dims, item_ref, span_ref, glob_ref, split):
  """-> (this program's item, its sequence, its row 0's position, its key
  end, the window, the key blocks [lo, hi) it streams): its item's own, or
  in a cluster the union of the members' (span_ref [clusters, 3])."""
  G, D, ps, ppb, slots, num_splits, scale, cluster = dims
  if cluster == 1:
    i = lax.axis_index("items")
    return (i, *mpa.item_span(item_ref, glob_ref, i, split, ps * ppb, num_splits))
  c = lax.axis_index("clusters")
  i = c * cluster + lax.axis_index("members")
  b, _, _, window, lo, hi = mpa.item_span(span_ref, glob_ref, c, split, ps * ppb, num_splits)
  return i, b, item_ref[i, 1], item_ref[i, 2], window, lo, hi


def _body(dims, q_ref, k_ref, v_ref, item_ref, tab_ref, glob_ref, span_ref, o_ref, lse_ref,
          q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, used_bar):
  """One (KV head, work item, split), as `mosaic_paged_attention._body`; in
  a cluster, one member."""
  G, D, ps, ppb, slots, num_splits, scale, cluster = dims
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
  for w in range(WGS):
    pl.when(wg == w)(lambda w=w: _compute(w, dims, span, issue, ins, out, q_smem, k_smem, v_smem,
                                          p_smem, o_smem, lse_smem))


def _compute(w, dims, span, issue, ins, out, q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem):
  """Warpgroup w: rows [64 w, 64 (w + 1)) of the item over every block (its
  own q tile copied by itself: one copy of both would stride 6 dimensions)."""
  G, D, ps, ppb, slots, num_splits, scale, _ = dims
  lo, hi, pos0, end, window = span
  q_item, q_bar, k_bar, v_bar, used_bar = ins
  plgpu.copy_gmem_to_smem(q_item.at[w], q_smem.at[w], q_bar.at[w])
  plgpu.barrier_wait(q_bar.at[w])
  keys = ps * ppb
  lay = plgpu.Layout.WGMMA
  row = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 0, layout=lay)
  col = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 1, layout=lay)
  q_pos = pos0 + lax.div(w * ROWS + row, jnp.int32(G))

  def step(blk, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(blk - lo, jnp.int32(slots))
    plgpu.barrier_wait(k_bar.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[w], k_smem.at[slot].T)
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, keys), jnp.float32)) * (scale * _LOG2E)
    k_pos = blk * keys + col
    visible = (k_pos <= q_pos) & (k_pos < end) & ((window == 0) | (q_pos - k_pos < window))
    p, alpha, m_new, l_i = softmax_step(s, visible, m_i, l_i)
    p_smem.at[w][...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(v_bar.at[slot])

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem.at[w], v_smem.at[slot])
      return acc_ref[...]
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, D), jnp.float32))
    plgpu.barrier_arrive(used_bar.at[slot])
    if w == 0:  # refill the slot once both warpgroups are done with it
      @pl.when(blk + slots < hi)
      def _():
        plgpu.barrier_wait(used_bar.at[slot])
        issue(blk + slots, slot)
    return acc, m_new, l_i

  o_smem.at[w][...], lse_smem.at[w][...] = finish(*lax.fori_loop(lo, hi, step,
                                                                 softmax_init(D)))
  if w == 0:
    mpa.wait_last_releases(used_bar, lo, hi, slots)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem.at[w], out[0].at[pl.ds(w * ROWS, ROWS)])
  plgpu.copy_smem_to_gmem(lse_smem.at[w], out[1].at[pl.ds(w * ROWS, ROWS)])
  plgpu.wait_smem_to_gmem(0)


def launch(rows, k_pages, v_pages, items, page_indices, layer, window, *, G, scale,
           num_splits, slots, block_keys, interpret, spans=None, cluster=1):
  """As `mosaic_paged_attention.launch` with rows [I, K, 128, D] -> (outputs
  [W, I, K, 128, D], log-sum-exps [W, I, K, 128]), float32. cluster > 1:
  item c * cluster + m is member m of cluster c, which streams the key
  blocks of spans[c] = (sequence, first item's position, last item's end)
  (I = clusters x cluster)."""
  I, K, _, D = rows.shape
  ps = k_pages.shape[-2]
  ppb = mpa.pages_per_block(ps, block_keys)
  table = page_indices.astype(jnp.int32)
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % ppb)))
  keys = ps * ppb
  tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  dims = (G, D, ps, ppb, slots, num_splits, float(scale), cluster)
  if cluster > 1:
    grid = dict(grid=(K, I // cluster, num_splits), grid_names=("heads", "clusters", "splits"),
                cluster=(cluster,), cluster_names=("members",))
    used = plgpu.ClusterBarrier(collective_axes=("members",), num_arrivals=WGS,
                                num_barriers=slots)
  else:
    grid = dict(grid=(K, I, num_splits), grid_names=("heads", "items", "splits"))
    used = plgpu.Barrier(num_arrivals=WGS, num_barriers=slots)
    spans = jnp.zeros((1, 3), jnp.int32)
  kernel = plgpu.kernel(
      lambda *refs: _body(dims, *refs),
      out_type=(jax.ShapeDtypeStruct((num_splits, I, K, WIDE_ROWS, D), jnp.float32),
                jax.ShapeDtypeStruct((num_splits, I, K, WIDE_ROWS), jnp.float32)),
      scratch_types=(plgpu.SMEM((WGS, ROWS, D), rows.dtype, transforms=tiles),
                     plgpu.SMEM((slots, keys, D), rows.dtype, transforms=tiles),
                     plgpu.SMEM((slots, keys, D), rows.dtype, transforms=tiles),
                     plgpu.SMEM((WGS, ROWS, keys), rows.dtype, transforms=tiles),
                     plgpu.SMEM((WGS, ROWS, D), jnp.float32),
                     plgpu.SMEM((WGS, ROWS), jnp.float32),
                     plgpu.Barrier(num_barriers=WGS),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots),
                     used),
      num_threads=WGS, thread_name="wg", **grid,
      interpret=_INTERPRETER() if interpret else False)
  glob = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
  return kernel(rows.reshape(I, K, WGS, ROWS, D), k_pages, v_pages, items.astype(jnp.int32),
                table, glob, spans.astype(jnp.int32))
