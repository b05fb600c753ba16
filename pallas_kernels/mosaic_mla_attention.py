"""DeepSeek MLA decode on Mosaic GPU (Hopper, jax >= 0.11): the absorbed form
over the latent page pool, each latent block read once for keys and values.

Same arguments and result as `mla_paged_attention` (q_latent [B, (Q,) N, R],
q_rope [B, (Q,) N, Hr], latent_pages [P, page_size, R + Hr], lengths,
page_indices; -> [B, (Q,) N, R]). One program per (row block, work item,
split) with two warpgroups (`launch`); a decode or verify step's items are
its sequences, a mixed step's its tokens in items of whole tokens
(`mosaic_mla_ragged`):

  rows    the Q x N query rows in blocks of 64 (a wgmma tile); DeepSeek's
          128 heads are two row blocks, 16 heads a device under TP one.
          cluster=True runs a sequence's row blocks (2 to 8) as one
          cluster of programs: each latent block is read from HBM once and
          multicast by TMA into every program's shared memory (each loads
          1 / blocks of it), and a slot is refilled only once every
          warpgroup of the cluster has released it (a cluster barrier).
          Without it each row block reads the whole latent (2x at 128 heads).
          An item's keys end at its last token, each row causal.
  keys    block_keys (32, or 64) latent rows a loop step, copied by TMA from
          the pool (at 32 a page of 64 is two steps; pages of 16 pair up),
          `slots` steps in flight. 64 halves the loop's steps (softmax,
          barriers) and doubles each S wgmma's width, in the shared memory
          of 4 slots of 32 (2 slots fit).
  math    both warpgroups compute S = q . latent^T (the 576-wide dot) and the
          same online softmax; each owns half of the 512 value columns of
          O += P V, so its f32 accumulator fits its registers: P goes to
          wgmma from registers and the product accumulates onto O in place
          (as jax's `attention_mgpu`), one [64, 256] accumulator (128
          registers a thread) and no spills (ptxas: 234-238 registers). The
          first warpgroup refills a slot once both have arrived on its barrier.
          split_scores=True: each warpgroup computes S over half of the 576
          columns instead of all of them (the whole step's tensor-core work
          1.5x -> 1x) and the two add their halves through shared memory
          (float32, double-buffered, a barrier a step); the sum is the same
          in both (addition commutes), so are their softmax statistics.
  smem    every tile swizzled block_keys x 2 bytes wide: wgmma takes its two
          operands in one swizzle (interpreted, P's [64, block_keys] tile
          goes through shared memory, that wide).

On CPU it runs in Mosaic GPU's interpret mode; jax 0.10 gets a named error.
Not yet: quantized latent pages; Q x N is padded to whole row blocks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla_paged_attention import prepare
from pallas_kernels.mosaic_paged_attention import (ROWS, SMEM_BYTES, INTERPRETER, available,
                                                   finish, merge_lse, plgpu, softmax_init,
                                                   softmax_step, wait_last_releases)
from pallas_kernels.paged_attention import validate_paged

KEYS = 32  # latent rows a loop step by default: P's [64, 32] tile, one 64-byte swizzle row
BLOCK_KEYS = (32, 64)  # the loop steps the kernel takes (swizzles of 64 and 128 bytes)
WGS = 2  # warpgroups, each with half of the value columns
MAX_CLUSTER = 8  # Hopper's portable cluster size: row blocks sharing one latent read
_LOG2E = math.log2(math.e)


def smem_bytes(D: int, R: int, slots: int, itemsize: int = 2, block_keys: int = KEYS,
               split_scores: bool = False) -> int:
  """q; `slots` latent blocks, then (the same bytes, once the loop is done)
  the output tiles of both warpgroups; lse; with split_scores the float32
  halves of S, two steps of each warpgroup's. (Interpreted, P's tiles add
  WGS x ROWS x block_keys; the interpreter has no shared-memory limit.)"""
  xchg = 2 * WGS * ROWS * block_keys * 4 if split_scores else 0
  return itemsize * (ROWS * D + max(slots * block_keys * D, ROWS * R)) + 4 * ROWS + xchg


def cluster_blocks(rows: int, cluster: bool) -> int:
  """Programs in a cluster for `rows` (= Q x N) query rows: their row
  blocks where cluster is asked for and they number 2 to MAX_CLUSTER, else 1."""
  blocks = -(-rows // ROWS)
  return blocks if cluster and 1 < blocks <= MAX_CLUSTER else 1


def unsupported(D: int, R: int, page_size: int, dtype, slots: int = 2, block_keys: int = KEYS,
                split_scores: bool = False):
  """(exception type, why) when the kernel cannot take these sizes, else None."""
  why = available()
  if why:
    return NotImplementedError, why
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return TypeError, f"q must be bfloat16 or float16 (wgmma inputs), got {jnp.dtype(dtype)}"
  if block_keys not in BLOCK_KEYS:
    return ValueError, f"block_keys must be one of {BLOCK_KEYS}, got {block_keys!r}"
  keys = block_keys
  if R % (WGS * keys) or D % keys:
    return ValueError, f"latent width {R} must be a multiple of {WGS * keys}, R + Hr of {keys}"
  if page_size % 8 or (page_size % keys and keys % page_size):
    return ValueError, f"page_size must divide or be a multiple of {keys}, got {page_size}"
  if not isinstance(slots, int) or slots < 2:
    return ValueError, f"slots must be an int >= 2, got {slots!r}"
  if not isinstance(split_scores, bool):
    return TypeError, f"split_scores must be a bool, got {split_scores!r}"
  used = smem_bytes(D, R, slots, jnp.dtype(dtype).itemsize, keys, split_scores)
  if used > SMEM_BYTES:
    return ValueError, f"{used} bytes of shared memory > {SMEM_BYTES} (fewer slots)"
  return None


class _Dims(NamedTuple):
  """A launch's static sizes and choices (`launch`'s arguments)."""
  N: int  # query heads
  R: int  # latent (value) width
  ps: int  # page size
  slots: int
  num_splits: int
  scale: float
  clustered: bool
  keys: int  # block_keys
  split_scores: bool


def _body(dims: _Dims, q_ref, kv_ref, item_ref, tab_ref, o_ref, lse_ref, q_smem, kvo_smem, lse_smem,
          q_bar, kv_bar, used_bar, done_bar, *extra):
  """One (row block, work item, split). item_ref [I, 3] int32: the item's
  sequence, the position of its first query token and the end of its keys
  (0: an empty item); row r of the item is query head r % N of its token
  r // N. kvo_smem: the latent slots and, once both warpgroups are done
  with them (done_bar), the output tiles in the same bytes. extra: S's
  halves and their barriers (split_scores), then P's tiles (interpreted)."""
  ps, num_splits, keys = dims.ps, dims.num_splits, dims.keys
  xchg, p_smem = extra[:2 * dims.split_scores], extra[2 * dims.split_scores:]
  kv_smem, o_smem = kvo_smem
  ppb = max(1, keys // ps)
  rb, i, split = lax.axis_index("rows"), lax.axis_index("items"), lax.axis_index("splits")
  wg = lax.axis_index("wg")
  b, pos0, end = item_ref[i, 0], item_ref[i, 1], item_ref[i, 2]
  blocks = lax.div(end + keys - 1, jnp.int32(keys))
  per = lax.div(blocks + num_splits - 1, jnp.int32(num_splits))
  lo = split * per
  hi = jnp.minimum(lo + per, blocks)

  def issue(blk, slot):
    n = min(ps, keys)
    for j in range(ppb):
      key0 = blk * keys + j * n
      page = tab_ref[b, lax.div(key0, jnp.int32(ps))]
      plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(lax.rem(key0, jnp.int32(ps)), n)],
                              kv_smem.at[slot, pl.ds(j * n, n)], kv_bar.at[slot],
                              collective_axes="rows" if dims.clustered else None)

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(q_ref.at[i, rb], q_smem, q_bar.at[0])
    for s in range(dims.slots):
      pl.when(lo + s < hi)(lambda s=s: issue(lo + s, s))
  plgpu.barrier_wait(q_bar.at[0])
  span = (pos0, end, lo, hi, rb, split, i)
  smem = (q_smem, kv_smem, o_smem, lse_smem, p_smem, xchg)
  for w in range(WGS):  # static slices of the value columns per warpgroup
    pl.when(wg == w)(lambda w=w: _compute(w, dims, span, issue, o_ref, lse_ref, smem,
                                          (kv_bar, used_bar, done_bar)))


def _compute(w, dims: _Dims, span, issue, o_ref, lse_ref, smem, bars):
  """Warpgroup w: the whole softmax, value columns [w * R/2, (w + 1) * R/2).
  p_smem: [the P tiles] where interpreted (Mosaic GPU's interpreter takes
  neither a register operand nor a stateful wgmma), else []."""
  N, R, slots, keys = dims.N, dims.R, dims.slots, dims.keys
  pos0, end, lo, hi, rb, split, i = span
  q_smem, kv_smem, o_smem, lse_smem, p_smem, xchg = smem
  kv_bar, used_bar, done_bar = bars
  half, lay = R // WGS, plgpu.Layout.WGMMA
  col = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 1, layout=lay)
  row = plgpu.broadcasted_iota(jnp.int32, (ROWS, keys), 0, layout=lay)
  q_pos = pos0 + lax.div(rb * ROWS + row, jnp.int32(N))

  def step(blk, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(blk - lo, jnp.int32(slots))
    plgpu.barrier_wait(kv_bar.at[slot])

    def qk(acc_ref):
      if xchg:  # this warpgroup's columns of the dot
        c0, c1 = score_columns(q_smem.shape[-1], keys, w)
        plgpu.wgmma(acc_ref, q_smem.at[:, pl.ds(c0, c1 - c0)],
                    kv_smem.at[slot, :, pl.ds(c0, c1 - c0)].T)
      else:
        plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot].T)
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, keys), jnp.float32))
    if xchg:
      s = _add_halves(s, w, lax.rem(blk - lo, jnp.int32(2)), *xchg)
    s = s * (dims.scale * _LOG2E)
    k_pos = blk * keys + col
    visible = (k_pos <= q_pos) & (k_pos < end)  # causal; rows past the item's tokens dropped
    p, alpha, m_new, l_i = softmax_step(s, visible, m_i, l_i)
    p16 = p.astype(kv_smem.dtype)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if p_smem:  # interpreted: P through shared memory, the product added (same sum)
      p_smem[0].at[w][...] = p16
      plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem[0].at[w] if p_smem else p16,
                  kv_smem.at[slot, :, pl.ds(w * half, half)])
    if p_smem:
      acc = acc + pl.run_scoped(lambda r: pv(r) or r[...], plgpu.ACC((ROWS, half), jnp.float32))
    else:  # P from registers, accumulated onto acc in place: one [64, R/2] accumulator
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(used_bar.at[slot])
    if w == 0:  # refill the slot once both warpgroups are done with it
      @pl.when(blk + slots < hi)
      def _():
        plgpu.barrier_wait(used_bar.at[slot])
        issue(blk + slots, slot)
    return acc, m_new, l_i

  o, lse = finish(*lax.fori_loop(lo, hi, step, softmax_init(half)))
  # The last releases, which no refill waited for: with a cluster no peer then still
  # arrives on this program's barriers after it exits; without one, every phase of
  # the barrier is observed before it is freed (jax 0.11.2's interpreter checks).
  if w == 0:
    wait_last_releases(used_bar, lo, hi, slots)
  # The output tiles share the latent slots' bytes: written once both are done with them.
  plgpu.barrier_arrive(done_bar.at[0])
  plgpu.barrier_wait(done_bar.at[0])
  o_smem.at[w][...] = o.astype(o_smem.dtype)
  if w == 0:
    lse_smem[...] = lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem.at[w], o_ref.at[split, i, rb, :, pl.ds(w * half, half)])
  if w == 0:
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, i, rb])
  plgpu.wait_smem_to_gmem(0)


def score_columns(D: int, keys: int, w: int) -> tuple[int, int]:
  """Warpgroup w's columns [c0, c1) of S's dot under split_scores: halves
  at a swizzle tile's edge (576 at 32 keys a step: 288 each; at 64: 320 and
  256)."""
  cut = (D // keys + 1) // 2 * keys
  return (0, cut) if w == 0 else (cut, D)


def _add_halves(s, w, parity, xs_smem, x_bar):
  """S from this warpgroup's half and the other's, through shared memory:
  buffer `parity` (a step's), so a warpgroup writes a buffer again only
  after the other has passed the next step's barrier, that is, has read it."""
  xs_smem.at[parity, w][...] = s
  plgpu.barrier_arrive(x_bar.at[parity])
  plgpu.barrier_wait(x_bar.at[parity])
  return s + plgpu.load(xs_smem.at[parity, 1 - w], layout=plgpu.Layout.WGMMA)


def launch(rows, latent_pages, items, page_indices, *, N, R, scale, num_splits=1, slots=2,
           cluster=False, block_keys=KEYS, split_scores=False, interpret=False):
  """The kernel over work items: rows [I, blocks, ROWS, D] (item i's query
  rows, row r = query head r % N of the item's token r // N), latent_pages
  [P, page_size, D], items [I, 3] int32 (sequence, position of the item's
  first token, end of its keys; 0: empty), page_indices [B, pages] ->
  (normalised outputs [W, I, blocks, ROWS, R] in q's dtype, log-sum-exps [W,
  I, blocks, ROWS] float32) of the W = num_splits splits (`merge_lse` joins
  them). cluster: an item's 2 to MAX_CLUSTER row blocks run as one cluster
  sharing each latent read. block_keys: latent rows a loop step (`BLOCK_KEYS`).
  split_scores: each warpgroup computes half of S's dot (module docstring)."""
  I, blocks, _, D = rows.shape
  ps, keys = latent_pages.shape[1], block_keys
  ppb = max(1, keys // ps)
  table = page_indices.astype(jnp.int32)
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % ppb)))  # whole blocks; padding masked
  tiles = (plgpu.TilingTransform((8, keys)), plgpu.SwizzleTransform(2 * keys))
  smem = lambda *shape: plgpu.SMEM(shape, rows.dtype, transforms=tiles)
  clustered = cluster_blocks(blocks * ROWS, cluster) > 1
  dims = _Dims(N, R, ps, slots, num_splits, float(scale), clustered, keys, split_scores)
  f32_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  xchg = (plgpu.SMEM((2, WGS, ROWS, keys), jnp.float32, transforms=f32_tiles),
          plgpu.Barrier(num_arrivals=WGS, num_barriers=2)) if split_scores else ()
  if clustered:  # the row blocks are one cluster's programs; slots released cluster-wide
    grid = dict(grid=(I, num_splits), grid_names=("items", "splits"), cluster=(blocks,),
                cluster_names=("rows",))
    used = plgpu.ClusterBarrier(collective_axes=("rows",), num_arrivals=WGS, num_barriers=slots)
  else:
    grid = dict(grid=(blocks, I, num_splits), grid_names=("rows", "items", "splits"))
    used = plgpu.Barrier(num_arrivals=WGS, num_barriers=slots)
  kernel = plgpu.kernel(
      lambda *refs: _body(dims, *refs),
      out_type=(jax.ShapeDtypeStruct((num_splits, I, blocks, ROWS, R), rows.dtype),
                jax.ShapeDtypeStruct((num_splits, I, blocks, ROWS), jnp.float32)),
      scratch_types=(smem(ROWS, D),
                     plgpu.RefUnion(smem(slots, keys, D), smem(WGS, ROWS, R // WGS)),
                     plgpu.SMEM((ROWS,), jnp.float32), plgpu.Barrier(num_barriers=1),
                     plgpu.Barrier(num_arrivals=ppb, num_barriers=slots), used,
                     plgpu.Barrier(num_arrivals=WGS, num_barriers=1), *xchg,
                     *([smem(WGS, ROWS, keys)] if interpret else [])),
      num_threads=WGS, thread_name="wg", **grid,
      interpret=INTERPRETER() if interpret else False)
  return kernel(rows, latent_pages, items.astype(jnp.int32), table)


def check_call(D, R, ps, dtype, slots, num_splits, cluster, name, block_keys=KEYS,
               split_scores=False):
  """Raise the named error `unsupported` (or the call's own arguments) finds."""
  bad = unsupported(D, R, ps, dtype, slots, block_keys, split_scores)
  if bad is None and not (isinstance(num_splits, int) and num_splits >= 1):
    bad = ValueError, f"num_splits must be an int >= 1, got {num_splits!r}"
  if bad is None and not isinstance(cluster, bool):
    bad = TypeError, f"cluster must be a bool, got {cluster!r}"
  if bad:
    raise bad[0](f"{name}: {bad[1]}")


def mosaic_mla_attention(q_latent, q_rope, latent_pages, lengths, page_indices, *, sm_scale,
                         num_splits=1, slots=2, cluster=False, block_keys=KEYS,
                         split_scores=False, interpret=False):
  """Absorbed MLA decode on Mosaic GPU (see the module docstring; shapes as
  `mla_paged_attention`). cluster: a sequence's row blocks share each latent
  read (`cluster_blocks`). block_keys: latent rows a loop step. split_scores:
  each warpgroup computes half of S's dot. interpret: run on CPU in Mosaic GPU's interpret mode
  (which copies the whole block into each program: a multicast's result)."""
  q, squeeze, R = prepare(q_latent, q_rope, latent_pages, "mosaic_mla_attention")
  validate_paged(q, latent_pages[None], None, lengths, page_indices, window=0, sinks=None,
                 name="mosaic_mla_attention")
  B, Q, N, D = q.shape
  check_call(D, R, latent_pages.shape[1], q.dtype, slots, num_splits, cluster,
             "mosaic_mla_attention", block_keys, split_scores)
  blocks = -(-Q * N // ROWS)
  rows = jnp.pad(q.reshape(B, Q * N, D), ((0, 0), (0, blocks * ROWS - Q * N), (0, 0)))
  lengths = lengths.astype(jnp.int32)
  items = jnp.stack([jnp.arange(B, dtype=jnp.int32), lengths - Q, lengths], axis=1)
  o, lse = launch(rows.reshape(B, blocks, ROWS, D), latent_pages, items, page_indices, N=N,
                  R=R, scale=sm_scale, num_splits=num_splits, slots=slots, cluster=cluster,
                  block_keys=block_keys, split_scores=split_scores, interpret=interpret)
  out = merge_lse(o.astype(jnp.float32), lse).reshape(B, blocks * ROWS, R)[:, :Q * N]
  out = out.reshape(B, Q, N, R).astype(q.dtype)
  return out[:, 0] if squeeze else out
